"""Token ids of the recipes' texts: prompts with the tokenizer's special tokens, continuations and steering tokens
without; batches are left-padded by :func:`gradpatch.model_io.left_pad` (re-exported here with
:func:`~gradpatch.model_io.pad_token_id`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gradpatch.model_io import left_pad, pad_token_id

from .errors import RecipeConfigError

__all__ = ["encode", "left_pad", "pad_token_id", "single_token_ids"]


def encode(tokenizer: Any, text: str, add_special_tokens: bool = True) -> list[int]:
    """Token ids of ``text`` (a Hugging Face tokenizer call).

    Raises:
        RecipeConfigError: ``text`` gives no tokens.
    """
    ids = list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])
    if not ids:
        raise RecipeConfigError(f"{text!r} encodes to no tokens; give a non-empty prompt or target")
    return ids


def single_token_ids(tokenizer: Any, words: Sequence[str]) -> list[int]:
    """The token id of each single-token string in ``words`` (steering sets).

    Raises:
        RecipeConfigError: a string that is several tokens (the message lists them) or none.
    """
    ids = []
    for word in words:
        encoded = encode(tokenizer, word, add_special_tokens=False)
        if len(encoded) != 1:
            pieces = [tokenizer.decode([i]) for i in encoded]
            raise RecipeConfigError(
                f"steering token {word!r} is {len(encoded)} tokens {pieces}; use single-token strings (mind the "
                f"leading space, e.g. ' Paris'), or put a multi-token continuation in objective.targets")
        ids.append(encoded[0])
    return ids
