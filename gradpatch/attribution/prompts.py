"""Clean/corrupted prompt pairs with an answer and a foil token: the input of every attribution method."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .errors import AttributionError

__all__ = ["PromptBatch", "prompt_batch"]

#: The keys of one prompt record (one JSONL line of ``gradpatch attribute --prompts``).
FIELDS = ("clean", "corrupted", "answer", "foil")


@dataclass(frozen=True)
class PromptBatch:
    """Token ids of ``batch`` prompt pairs, all of one length (positions are shared across the batch).

    Attributes:
        clean: ``[batch, seq]`` token ids of the clean prompts.
        corrupted: ``[batch, seq]`` token ids of the corrupted prompts.
        answer: ``[batch]`` the answer token of each clean prompt.
        foil: ``[batch]`` the foil token (the answer of the corrupted prompt).
    """

    clean: torch.Tensor
    corrupted: torch.Tensor
    answer: torch.Tensor
    foil: torch.Tensor

    def __post_init__(self) -> None:
        if self.clean.dim() != 2 or self.clean.shape != self.corrupted.shape:
            raise AttributionError(f"clean {tuple(self.clean.shape)} and corrupted {tuple(self.corrupted.shape)} token "
                                   f"ids must both be [batch, seq] of one shape: make the corrupted prompts the same "
                                   f"token length as the clean ones")
        batch = self.clean.shape[0]
        if self.answer.shape != (batch,) or self.foil.shape != (batch,):
            raise AttributionError(f"answer {tuple(self.answer.shape)} and foil {tuple(self.foil.shape)} must be "
                                   f"[batch] = [{batch}] token ids")

    @property
    def size(self) -> int:
        """Number of prompt pairs."""
        return int(self.clean.shape[0])

    @property
    def length(self) -> int:
        """Number of tokens of every prompt."""
        return int(self.clean.shape[1])

    def to(self, device: torch.device | str) -> "PromptBatch":
        """The same batch on ``device``."""
        return PromptBatch(*(t.to(device) for t in (self.clean, self.corrupted, self.answer, self.foil)))


def _ids(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text).input_ids)


def _one_token(tokenizer: Any, text: str, what: str, line: int) -> int:
    ids = list(tokenizer(text, add_special_tokens=False).input_ids)
    if len(ids) != 1:
        raise AttributionError(f"line {line}: the {what} {text!r} is {len(ids)} tokens {ids}; give a single-token "
                               f"{what} (usually with its leading space, e.g. ' Paris')")
    return ids[0]


def prompt_batch(tokenizer: Any, records: Sequence[Mapping[str, str]]) -> PromptBatch:
    """Tokenize prompt records ``{"clean", "corrupted", "answer", "foil"}`` into a :class:`PromptBatch`.

    Args:
        tokenizer: a Hugging Face tokenizer (``tokenizer(text).input_ids``).
        records: one mapping per prompt pair; lines are counted from 1 in messages.

    Raises:
        AttributionError: a missing field; an answer or foil that is not one token; clean and corrupted prompts of
            different token lengths; prompts of different lengths across records (positions are shared).
    """
    if not records:
        raise AttributionError("no prompts: give at least one {clean, corrupted, answer, foil} record")
    clean, corrupted, answer, foil = [], [], [], []
    for line, record in enumerate(records, start=1):
        missing = [key for key in FIELDS if not isinstance(record.get(key), str)]
        if missing:
            raise AttributionError(f"line {line}: missing or non-string fields {missing}; each line needs "
                                   f"{{\"clean\", \"corrupted\", \"answer\", \"foil\"}} strings")
        a, b = _ids(tokenizer, record["clean"]), _ids(tokenizer, record["corrupted"])
        if len(a) != len(b):
            raise AttributionError(f"line {line}: the clean prompt is {len(a)} tokens and the corrupted one {len(b)}; "
                                   f"activation patching pairs positions, so rephrase the corrupted prompt to "
                                   f"{len(a)} tokens (e.g. swap a name for another single-token name)")
        if clean and len(a) != len(clean[0]):
            raise AttributionError(f"line {line} is {len(a)} tokens but line 1 is {len(clean[0])}: positions are "
                                   f"shared across the file, so put prompts of one token length in one file (split the "
                                   f"file by length)")
        clean.append(a)
        corrupted.append(b)
        answer.append(_one_token(tokenizer, record["answer"], "answer", line))
        foil.append(_one_token(tokenizer, record["foil"], "foil", line))
    return PromptBatch(torch.tensor(clean), torch.tensor(corrupted), torch.tensor(answer), torch.tensor(foil))
