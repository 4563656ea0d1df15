"""The start token: a token put before every text an editor reads or scores, so no word of it sits at position 0.

A causal LM trained on packed documents saw each one after a separator token; Llama-style tokenizers add a BOS token
for the same reason. Tokenizers that add nothing (GPT-2's, SmolLM2's) leave the first word of a text at position 0,
where the attention sink forms: there SmolLM2-135M neither recalls a fact well ("France's capital city is": log-prob of
" Paris" -4.16, -0.91 after ``<|endoftext|>``) nor lets a ROME edit reach it (docs/rome.md, "The start token").

:func:`with_start_token` returns a copy of the tokenizer that puts the token first, so keys, values, statistics and
the evaluation of an editor all see the same texts; the caller's tokenizer is left as it was.
"""

from __future__ import annotations

import copy
from typing import Any

__all__ = ["AUTO", "DOCUMENT_SEPARATOR", "resolve_start_token", "start_token_tag", "with_start_token"]

#: ``start_token`` setting: the document separator if the vocabulary has one, else the tokenizer's BOS token.
AUTO = "auto"
#: The GPT-2 family's document separator (GPT-2, SmolLM2, Qwen, Pythia), which pretraining put before each document.
DOCUMENT_SEPARATOR = "<|endoftext|>"


def _first_is_special(tokenizer: Any) -> bool:
    """Whether the tokenizer already puts a special token (e.g. Llama's BOS) before a text."""
    ids = list(tokenizer("a")["input_ids"])
    return bool(ids) and ids[0] in set(getattr(tokenizer, "all_special_ids", []) or [])


def resolve_start_token(tokenizer: Any, setting: str | None) -> str | None:
    """The token :func:`with_start_token` would put before every text, or ``None`` (nothing is added).

    Args:
        tokenizer: a Hugging Face tokenizer.
        setting: ``"auto"`` (:data:`DOCUMENT_SEPARATOR` if the vocabulary has it, else ``tokenizer.bos_token``, else
            nothing), a token of the vocabulary, or ``None`` (nothing). A tokenizer that already begins every text
            with a special token gets nothing more, whatever the setting.

    Raises:
        ValueError: ``setting`` is a string that is neither ``"auto"`` nor a single token of the vocabulary.
    """
    if setting is None or _first_is_special(tokenizer):
        return None
    vocabulary = tokenizer.get_vocab()
    if setting == AUTO:
        if DOCUMENT_SEPARATOR in vocabulary:
            return DOCUMENT_SEPARATOR
        return getattr(tokenizer, "bos_token", None) or None
    if setting not in vocabulary:
        raise ValueError(f"start_token {setting!r} is not a token of the tokenizer's vocabulary: give one of its "
                         f"special tokens (e.g. {getattr(tokenizer, 'eos_token', None)!r}), 'auto', or None for none "
                         f"(--start-token none)")
    return setting


def with_start_token(tokenizer: Any, setting: str | None) -> Any:
    """``tokenizer``, or a copy of it that puts the start token before every text it encodes.

    Args:
        tokenizer: a Hugging Face tokenizer (left unchanged).
        setting: as :func:`resolve_start_token`.

    Returns:
        ``tokenizer`` itself when :func:`resolve_start_token` gives ``None``; otherwise a deep copy with that token as
        ``bos_token`` and ``add_bos_token=True``: ``copy("France")["input_ids"]`` is ``[start, France's ids...]`` and
        its offsets give the start token an empty span, so subject and target positions shift by one.

    Raises:
        ValueError: as :func:`resolve_start_token`, or the tokenizer's class does not add a BOS token on request (the
            message names ``start_token=None``).
    """
    token = resolve_start_token(tokenizer, setting)
    if token is None:
        return tokenizer
    prefixed = copy.deepcopy(tokenizer)
    prefixed.bos_token = token
    prefixed.add_bos_token = True
    ids = list(prefixed("a")["input_ids"])
    if not ids or ids[0] != prefixed.convert_tokens_to_ids(token):
        raise ValueError(f"{type(tokenizer).__name__} does not put {token!r} before a text with add_bos_token=True; "
                         f"edit without a start token (start_token=None, --start-token none)")
    return prefixed


def start_token_tag(tokenizer: Any) -> str:
    """A cache-key part for what the tokenizer puts before every text: ``""`` for nothing, else ``"__start<ids>"``
    (e.g. ``"__start0"``), so statistics and context prefixes computed with a start token are cached apart."""
    ids = list(tokenizer("")["input_ids"])
    return "__start" + "-".join(str(i) for i in ids) if ids else ""
