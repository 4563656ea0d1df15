"""Token bookkeeping for editing: subject positions and prompt/target boundaries (right-padded batches:
:func:`gradpatch.model_io.right_pad`).

Tokenizers differ in how they treat leading spaces and BOS tokens (GPT-2's BPE adds no BOS and folds the space
into the next token; Llama-style tokenizers add a BOS token and may mark spaces with ``▁``). Everything here
works on character offsets (``return_offsets_mapping`` of fast tokenizers) and falls back to comparing
tokenizations of text prefixes for slow tokenizers, so no rule is hard-coded per model family.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import SubjectNotFoundError, TokenizationError

__all__ = [
    "EncodedPrompt",
    "common_prefix_length",
    "encode",
    "encode_prompt_target",
    "encode_subject_prompt",
    "format_with_span",
    "prompt_and_span",
    "sorted_chunks",
    "subject_char_span",
    "subject_token_range",
]


@dataclass(frozen=True)
class EncodedPrompt:
    """A tokenized text with the positions an editor needs.

    Attributes:
        ids: token ids of the whole text (special tokens such as BOS included), length ``seq``.
        subject_last: index of the subject's last token in ``ids`` (``-1`` when there is no subject).
        target_start: index of the first target token (``len(ids)`` when there is no target).
    """

    ids: list[int]
    subject_last: int = -1
    target_start: int = -1

    @property
    def n_target(self) -> int:
        """Number of target tokens at the end of ``ids``."""
        return len(self.ids) - self.target_start if self.target_start >= 0 else 0


def _offsets(tokenizer: Any, text: str) -> tuple[list[int], list[tuple[int, int]] | None]:
    """Token ids of ``text`` (special tokens added as the tokenizer does) and their character spans.

    Returns:
        ``(ids, offsets)``; ``offsets`` is ``None`` for tokenizers without offset mapping. Special tokens get
        the span ``(0, 0)`` (or another empty span) and never count as subject or target tokens.
    """
    try:
        enc = tokenizer(text, return_offsets_mapping=True)
    except (NotImplementedError, TypeError, ValueError):
        return list(tokenizer(text)["input_ids"]), None
    ids = list(enc["input_ids"])
    offsets = [tuple(o) for o in enc["offset_mapping"]]
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    offsets = [(0, 0) if (t in special and a == b) else (a, b) for t, (a, b) in zip(ids, offsets)]
    return ids, offsets  # type: ignore[return-value]


def encode(tokenizer: Any, text: str) -> list[int]:
    """Token ids of ``text`` as the tokenizer produces them for a model input (BOS included if it adds one)."""
    return list(tokenizer(text)["input_ids"])


def common_prefix_length(rows: Sequence[Sequence[int]], limit: int | None = None) -> int:
    """Length of the longest token prefix common to all ``rows``, at most ``limit`` (if given)."""
    length = min(len(row) for row in rows) if limit is None else min([limit, *(len(row) for row in rows)])
    first = rows[0]
    for row in rows[1:]:
        length = next((i for i in range(length) if row[i] != first[i]), length)
    return length


def sorted_chunks(widths: Sequence[int], max_tokens: int, first_rows: int | None = None) -> list[list[int]]:
    """Consecutive groups of the indices of ``widths`` (ascending: each group's last row is its widest) whose rows ×
    widest width stay within ``max_tokens``; a row wider than that forms a group of its own. With ``first_rows`` the
    first group holds at most that many rows: a pass that may be the first of a new kind of call, which gradpatch
    extracts graphs for by running it once more through the whole model (every layer, the logits at every position),
    costs little when small."""
    groups: list[list[int]] = []
    for i, width in enumerate(widths):
        full = len(groups) == 1 and first_rows is not None and len(groups[0]) >= first_rows
        if groups and not full and (len(groups[-1]) + 1) * width <= max_tokens:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def _last_token_before(tokenizer: Any, text: str, ids: list[int], end: int) -> int:
    """Index (in ``ids``) of the last token that covers characters before ``end`` (slow-tokenizer fallback).

    The tokens of ``text[:end]`` that agree with the tokens of ``text`` cover the prefix; the last of them
    (or the first differing one, which then straddles ``end``) holds the character ``end - 1``.
    """
    prefix_ids = encode(tokenizer, text[:end])
    n = common_prefix_length([prefix_ids, ids])
    if n == len(prefix_ids):
        return n - 1
    return n  # the token at n straddles the boundary: it contains text[end - 1]


def subject_char_span(prompt: str, subject: str) -> tuple[int, int]:
    """Character span ``[start, end)`` of ``subject`` in a formatted prompt (its last occurrence).

    Args:
        prompt: text that contains ``subject``.
        subject: the subject string, e.g. ``"Eiffel Tower"``.

    Returns:
        ``(start, end)``.

    Raises:
        SubjectNotFoundError: ``subject`` is empty or not in ``prompt``.
    """
    if not subject:
        raise SubjectNotFoundError("The subject is empty: give the entity whose fact is edited, e.g. 'Eiffel Tower'")
    start = prompt.rfind(subject)
    if start < 0:
        raise SubjectNotFoundError(
            f"Subject {subject!r} does not occur in {prompt!r}: write the prompt with a '{{}}' placeholder that "
            f"the subject fills, e.g. '{{}} is located in'"
        )
    return start, start + len(subject)


def subject_token_range(tokenizer: Any, text: str, span: tuple[int, int]) -> tuple[list[int], tuple[int, int]]:
    """Tokenize ``text`` and find the tokens covering the subject's characters ``span``.

    A token belongs to the subject when its character span overlaps ``span`` (so a leading-space token like
    GPT-2's ``" Tower"`` or Llama's ``"▁Tower"`` counts, and a BOS token never does). Slow tokenizers without
    offsets fall back to comparing tokenizations of the text up to the subject's first and last characters (a
    token straddling a boundary counts as the subject's).

    Args:
        tokenizer: a Hugging Face tokenizer.
        text: the full prompt.
        span: ``(start, end)`` characters of the subject in ``text``.

    Returns:
        ``(ids, (first, stop))``: the token ids of ``text`` and the subject's token positions ``[first, stop)``.

    Raises:
        SubjectNotFoundError: no token covers the subject.
    """
    start, end = span
    ids, offsets = _offsets(tokenizer, text)
    if offsets is not None:
        hits = [i for i, (a, b) in enumerate(offsets) if b > a and a < end and b > start]
        first, last = (hits[0], hits[-1]) if hits else (0, -1)
    else:
        first = _last_token_before(tokenizer, text, ids, start + 1)
        last = _last_token_before(tokenizer, text, ids, end)
    if not 0 <= first <= last < len(ids):
        raise SubjectNotFoundError(
            f"No token of {text!r} covers the subject at characters {span}: check the subject is spelled as in "
            f"the prompt"
        )
    return ids, (first, last + 1)


def encode_subject_prompt(tokenizer: Any, text: str, span: tuple[int, int]) -> EncodedPrompt:
    """Tokenize ``text`` and find the last token of the subject occupying characters ``span``
    (:func:`subject_token_range`'s last position).

    Args:
        tokenizer: a Hugging Face tokenizer (fast ones use offsets; slow ones compare tokenizations).
        text: the full prompt.
        span: ``(start, end)`` characters of the subject in ``text``.

    Returns:
        An :class:`EncodedPrompt` with ``subject_last`` set.

    Raises:
        SubjectNotFoundError: no token covers the subject.
    """
    ids, (_, stop) = subject_token_range(tokenizer, text, span)
    return EncodedPrompt(ids=ids, subject_last=stop - 1)


def encode_prompt_target(
    tokenizer: Any, prompt: str, target: str, subject_span: tuple[int, int] | None = None
) -> EncodedPrompt:
    """Tokenize ``prompt + " " + target`` and mark where the target tokens start.

    CounterFact targets are stored without their leading space; they are scored as the continuation
    ``" " + target`` of the prompt. The target tokens are those starting at or after the end of ``prompt``
    (character offsets); the prompt's own tokens must be a prefix of the tokenization of the whole text.

    Args:
        tokenizer: a Hugging Face tokenizer.
        prompt: the prompt, e.g. ``"The Eiffel Tower is located in"``.
        target: the target without leading space, e.g. ``"Rome"``.
        subject_span: optional subject character span in ``prompt`` to locate its last token too.

    Returns:
        An :class:`EncodedPrompt` with ``target_start`` (and ``subject_last`` if ``subject_span`` was given).

    Raises:
        TokenizationError: the target is empty, or a token straddles the prompt/target boundary.
    """
    if not target.strip():
        raise TokenizationError("The target is empty: give the object text, e.g. 'Rome'")
    text = f"{prompt} {target.lstrip()}" if not prompt.endswith(" ") else prompt + target.lstrip()
    boundary = len(prompt.rstrip(" "))
    ids, offsets = _offsets(tokenizer, text)
    if offsets is not None:
        nonempty = [i for i, (a, b) in enumerate(offsets) if b > a]
        target_start = next((i for i in nonempty if offsets[i][0] >= boundary), None)
        straddle = [i for i in nonempty if offsets[i][0] < boundary < offsets[i][1]]
        if straddle or target_start is None:
            raise TokenizationError(
                f"A token of {text!r} straddles the prompt/target boundary; end the prompt at a word boundary "
                f"(no trailing space) and give the target without leading space"
            )
    else:
        prompt_ids = encode(tokenizer, prompt.rstrip(" "))
        target_start = common_prefix_length([prompt_ids, ids])
        if target_start != len(prompt_ids) or target_start >= len(ids):
            raise TokenizationError(
                f"The tokens of {prompt!r} are not a prefix of the tokens of {text!r}; use a fast tokenizer "
                f"(return_offsets_mapping) or end the prompt at a word boundary"
            )
    subject_last = -1
    if subject_span is not None:
        subject_last = encode_subject_prompt(tokenizer, text, subject_span).subject_last
        if subject_last >= target_start:
            raise SubjectNotFoundError(f"The subject at {subject_span} is not inside the prompt {prompt!r}")
    return EncodedPrompt(ids=ids, subject_last=subject_last, target_start=target_start)


def format_with_span(template: str, subject: str, prefix: str = "") -> tuple[str, tuple[int, int]]:
    """Fill a ``"{}"`` template with the subject, behind an optional context prefix.

    The subject's span is computed from the template's structure, never searched for, so a prefix or template
    that happens to contain the subject text cannot mislead it.

    Args:
        template: text with exactly one ``"{}"``, e.g. ``"The capital of {} is"``.
        subject: the subject, e.g. ``"France"``.
        prefix: context text placed before the filled template (ROME's context templates).

    Returns:
        ``(text, (start, end))`` with the subject's character span in ``text``.

    Raises:
        SubjectNotFoundError: the template has no or several ``"{}"``, or the subject is empty.
    """
    if template.count("{}") != 1:
        raise SubjectNotFoundError(
            f"Template {template!r} must contain exactly one '{{}}' where the subject goes, e.g. '{{}} is located in'"
        )
    if not subject:
        raise SubjectNotFoundError("The subject is empty: give the entity whose fact is edited, e.g. 'Eiffel Tower'")
    head, tail = template.split("{}")
    start = len(prefix) + len(head)
    return prefix + head + subject + tail, (start, start + len(subject))


def prompt_and_span(prompt: str, subject: str) -> tuple[str, tuple[int, int]]:
    """The prompt text and the subject's character span in it: fills a ``"{}"`` template
    (:func:`format_with_span`) or finds the subject's last occurrence in a full text (:func:`subject_char_span`).

    Raises:
        SubjectNotFoundError: no ``"{}"`` and the subject is not in the prompt (or is empty), or several ``"{}"``.
    """
    if "{}" in prompt:
        return format_with_span(prompt, subject)
    return prompt, subject_char_span(prompt, subject)


