"""Training rows of the delta recipes: tokenized prompts, left-padded into batches.

Every row is scored at its last position, so rows are **left-padded**: position ``-1`` is the last real token of
every row, and a delta at ``slice=(slice(None), -1)`` lands on it. ``position_ids`` are computed from the
attention mask (``cumsum - 1``), so models with absolute position embeddings see the same positions as
without padding.

A target continuation of ``T`` tokens becomes ``T`` rows: ``prompt + target[:t] -> target[t]``. This is exactly how
greedy generation without a cache sees the intervention (at every step the whole sequence is run and the delta is
added at its current last token), so what is trained is what generation does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import Dataset

from gradpatch.model_io import left_pad

from ..tokens import encode
from .objectives import KIND_KL, KIND_STEER, KIND_TARGET
from .specs import Objective

__all__ = ["KIND_KL", "KIND_STEER", "KIND_TARGET", "PromptRows", "Row", "RowCollator", "build_rows", "collate_rows"]


@dataclass(frozen=True)
class Row:
    """One training row.

    Attributes:
        ids: token ids of the input (prompt, plus target tokens before the predicted one).
        kind: :data:`KIND_TARGET`, :data:`KIND_STEER` or :data:`KIND_KL`.
        target: the token to predict (target rows), else ``-1``.
        weight: ``1 / len(target tokens)`` for target rows (each continuation counts once), else ``1``.
        kl_index: index into ``Objective.kl_prompts`` (KL rows), else ``-1``.
    """

    ids: tuple[int, ...]
    kind: int
    target: int = -1
    weight: float = 1.0
    kl_index: int = -1


def build_rows(tokenizer: Any, objective: Objective) -> list[Row]:
    """All training rows of ``objective``: target rows, then steering rows, then KL rows.

    Args:
        tokenizer: a Hugging Face tokenizer (prompts are encoded with special tokens, targets without).
        objective: the objective.

    Returns:
        The rows, in that order.

    Raises:
        RecipeConfigError: an empty prompt or target, or an objective without terms.
    """
    objective.term_names()  # validates
    rows: list[Row] = []
    for spec in objective.targets:
        prompt = encode(tokenizer, spec.prompt)
        target = encode(tokenizer, spec.target, add_special_tokens=False)
        for t, token in enumerate(target):
            rows.append(Row(tuple(prompt + target[:t]), KIND_TARGET, target=token, weight=1.0 / len(target)))
    for prompt_text in objective.steer_prompts:
        rows.append(Row(tuple(encode(tokenizer, prompt_text)), KIND_STEER))
    for index, prompt_text in enumerate(objective.kl_prompts):
        rows.append(Row(tuple(encode(tokenizer, prompt_text)), KIND_KL, kl_index=index))
    return rows


class PromptRows(Dataset):
    """A map-style dataset of :class:`Row`; batch it with :func:`collate_rows` (``pad_id`` bound)."""

    def __init__(self, rows: Sequence[Row]) -> None:
        self.rows = list(rows)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> Row:
        return self.rows[index]


@dataclass(frozen=True)
class RowCollator:
    """Picklable collate function: :func:`collate_rows` with a fixed pad id."""

    pad_id: int

    def __call__(self, rows: Sequence[Row]) -> dict[str, torch.Tensor]:
        return collate_rows(rows, self.pad_id)


def collate_rows(rows: Sequence[Row], pad_id: int) -> dict[str, torch.Tensor]:
    """A batch of rows.

    Args:
        rows: ``B`` rows.
        pad_id: the pad token id.

    Returns:
        ``input_ids``, ``attention_mask``, ``position_ids`` ``[B, S]`` (left-padded, see
        :func:`gradpatch.model_io.left_pad`) and per row ``kind`` ``[B]`` (int64), ``target`` ``[B]`` (int64, -1 when none), ``weight`` ``[B]`` (float32) and
        ``kl_index`` ``[B]`` (int64, -1 when none).
    """
    batch = left_pad([row.ids for row in rows], pad_id)
    batch["kind"] = torch.tensor([row.kind for row in rows], dtype=torch.long)
    batch["target"] = torch.tensor([row.target for row in rows], dtype=torch.long)
    batch["weight"] = torch.tensor([row.weight for row in rows], dtype=torch.float32)
    batch["kl_index"] = torch.tensor([row.kl_index for row in rows], dtype=torch.long)
    return batch
