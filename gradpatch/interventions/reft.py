"""Representation fine-tuning patches: LoReFT and DiReFT at the first and last tokens of a prompt.

ReFT (Wu et al. 2024, "ReFT: Representation Finetuning for Language Models", arXiv 2404.03592) trains a low-rank
edit Φ of a frozen model's hidden representations ``h`` (``[..., d]``) at a few prompt positions:

- :class:`LoReFTPatch` (section 3.1, eq. 2): Φ(h) = h + Rᵀ(W h + b − R h), R ∈ ℝ^{r×d} with orthonormal rows (torch's
  orthogonal parametrization), W ∈ ℝ^{r×d}, b ∈ ℝ^r.
- :class:`DiReFTPatch` (section 3.3): Φ(h) = h + W₂ᵀ(W₁ h + b), W₁, W₂ ∈ ℝ^{r×d}, no orthogonality.
- :class:`AddVectorPatch`: Φ(h) = h + v, v ∈ ℝ^d: the full-vector additive baseline at the same positions.

Positions follow pyreft: ``"f7+l7"`` is the first 7 and the last 7 tokens of the prompt (:class:`ReFTPositions`).
Each patch records its positions and its ``part`` (``"all"`` positions with weights tied across them, or only the
``"first"`` / ``"last"`` ones, two patches with untied weights), so a saved :class:`~gradpatch.Intervention`
knows where it applies. The patches are :class:`~gradpatch.interventions.TrainablePatch` subclasses (their kinds are
registered in :data:`gradpatch.interventions.subspace.TRAINABLE_KINDS` for save/load); :func:`reft_patch_map` places
them at the prompt positions of a left-padded batch, and :func:`prefill_patch_map` does it for the prefill pass of
KV-cache generation only (the generated tokens are not intervened on, as in pyreft).
"""

from __future__ import annotations

import re
from pathlib import Path
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from ..errors import InterventionLoadError, SubspaceConfigError
from ..files.atomic import read_json
from .intervention import JSON_NAME
from ..patches import Patch, Slice
from .subspace import TRAINABLE_KINDS, TrainablePatch, orthogonal_linear

__all__ = ["AddVectorPatch", "DiReFTPatch", "LoReFTPatch", "PromptPositionsPatch", "ReFTPatch", "ReFTPositions",
           "Part", "check_saved_reft", "prefill_patch_map", "reft_patch_map"]

#: Which of a patch's positions it applies to: every one (tied weights), or the first / last ones (untied).
Part = Literal["all", "first", "last"]
_PARTS = ("all", "first", "last")


@dataclass(frozen=True)
class ReFTPositions:
    """The first ``first`` and last ``last`` tokens of a prompt (pyreft's ``"f{first}+l{last}"``).

    Attributes:
        first: p ≥ 0 tokens from the start.
        last: s ≥ 0 tokens from the end (p + s ≥ 1).
    """

    first: int
    last: int

    @classmethod
    def parse(cls, text: str) -> "ReFTPositions":
        """``"f7+l7"``, ``"f3"``, ``"l1"`` -> positions.

        Raises:
            SubspaceConfigError: another spelling, or no position at all.
        """
        match = re.fullmatch(r"\s*(?:f(\d+))?\s*\+?\s*(?:l(\d+))?\s*", str(text))
        if not match or not (match.group(1) or match.group(2)):
            raise SubspaceConfigError(f"positions {text!r} are not 'f<p>+l<s>' (e.g. 'f7+l7', 'f3', 'l1')")
        positions = cls(int(match.group(1) or 0), int(match.group(2) or 0))
        if positions.first + positions.last < 1:
            raise SubspaceConfigError(f"positions {text!r} select no token; use e.g. 'l1' or 'f7+l7'")
        return positions

    def __str__(self) -> str:
        return "+".join(part for part in (f"f{self.first}" if self.first else "",
                                          f"l{self.last}" if self.last else "") if part)

    def columns(self, length: int, part: Part = "all") -> list[int]:
        """Token indices (into a prompt of ``length`` tokens) of ``part`` of the positions, in increasing order.

        Raises:
            SubspaceConfigError: the positions do not fit the prompt (p + s > length), naming the fix.
        """
        if self.first + self.last > length:
            raise SubspaceConfigError(f"positions '{self}' need {self.first + self.last} prompt tokens, but a prompt "
                                      f"has {length}: use fewer positions (e.g. 'f{length // 2}+l{length // 2}') or "
                                      f"longer prompts")
        first, last = list(range(self.first)), list(range(length - self.last, length))
        return first if part == "first" else last if part == "last" else first + last

    def parts(self, tied: bool) -> list[Part]:
        """The parts one patch per part covers: ``["all"]`` when tied (or one side is empty), else first and last."""
        if tied or not self.first or not self.last:
            return ["all"]
        return ["first", "last"]


class ReFTPatch(TrainablePatch):
    """Base class of the ReFT patches: an edit Φ(h) of the activation itself (no source).

    As a patch in ``pg.patch`` it edits ``activation[slice]``; :func:`reft_patch_map` applies it at prompt positions.

    Args:
        width: ``d``, the node's last dimension.
        positions: where it is trained and applied, e.g. ``"f7+l7"``.
        part: ``"all"``, ``"first"`` or ``"last"`` of those positions.
        slice: as any patch's, when used directly in ``pg.patch``.

    Raises:
        SubspaceConfigError: bad positions or part.
    """

    def __init__(self, width: int, positions: str = "l1", part: Part = "all", slice: Slice = None) -> None:
        super().__init__(width, slice)
        self.positions = ReFTPositions.parse(positions)
        if part not in _PARTS:
            raise SubspaceConfigError(f"part {part!r} is not one of {_PARTS}")
        if (part == "first" and not self.positions.first) or (part == "last" and not self.positions.last):
            raise SubspaceConfigError(f"part {part!r} of positions '{self.positions}' is empty")
        self.part: Part = part

    def op(self, original: torch.Tensor) -> torch.Tensor:
        return self.edit(original)

    def intervene(self, base: torch.Tensor, source: torch.Tensor | None = None) -> torch.Tensor:
        """Φ(base); ``source`` is ignored (ReFT edits the representation itself)."""
        return self.edit(base)

    def edit(self, h: torch.Tensor) -> torch.Tensor:
        """Φ(h) ``[..., d]`` from h ``[..., d]`` (computed in ``h``'s dtype)."""
        raise NotImplementedError

    def config(self) -> dict[str, Any]:
        return {"width": self.width, "positions": str(self.positions), "part": self.part}


def _check_rank(name: str, rank: Any, width: int) -> int:
    if isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank < width:
        raise SubspaceConfigError(f"{name}: rank={rank!r} must be an int in 1..{width - 1} (below the node's width "
                                  f"{width}); a rank-{width} edit is a full linear map: choose a lower rank")
    return rank


class LoReFTPatch(ReFTPatch):
    """Low-rank linear subspace ReFT: Φ(h) = h + Rᵀ(W h + b − R h) (Wu et al. 2024, eq. 2).

    Args:
        width: ``d``.
        rank: r, 1 ≤ r < d.
        positions, part, slice: as :class:`ReFTPatch`.

    Attributes:
        rotation: ``nn.Linear(d, r)`` whose weight R ``[r, d]`` has orthonormal rows (orthogonal parametrization).
        projection: ``nn.Linear(d, r)``: W ``[r, d]`` and b ``[r]``.

    Raises:
        SubspaceConfigError: rank outside 1..d−1, bad positions or part.
    """

    def __init__(self, width: int, rank: int, positions: str = "l1", part: Part = "all", slice: Slice = None) -> None:
        super().__init__(width, positions, part, slice)
        self.rank = _check_rank("LoReFTPatch", rank, width)
        self.rotation = orthogonal_linear(rank, width)
        self.projection = nn.Linear(width, rank)

    @property
    def R(self) -> torch.Tensor:  # noqa: N802 (the paper's name)
        """R ``[r, d]``, orthonormal rows."""
        return self.rotation.weight

    def edit(self, h: torch.Tensor) -> torch.Tensor:
        rotation = self.R.to(h.dtype)
        learned = nn.functional.linear(h, self.projection.weight.to(h.dtype), self.projection.bias.to(h.dtype))
        return h + (learned - h @ rotation.T) @ rotation

    def config(self) -> dict[str, Any]:
        return {**super().config(), "rank": self.rank}


class DiReFTPatch(ReFTPatch):
    """Direct ReFT: Φ(h) = h + W₂ᵀ(W₁ h + b) (Wu et al. 2024, section 3.3; no orthogonality, no subtraction).

    Args:
        width: ``d``.
        rank: r, 1 ≤ r < d.
        positions, part, slice: as :class:`ReFTPatch`.

    Attributes:
        projection: ``nn.Linear(d, r)``: W₁ ``[r, d]`` and b ``[r]``.
        up: W₂ ``[r, d]`` (orthogonal rows at initialisation, as pyreft).

    Raises:
        SubspaceConfigError: rank outside 1..d−1, bad positions or part.
    """

    def __init__(self, width: int, rank: int, positions: str = "l1", part: Part = "all", slice: Slice = None) -> None:
        super().__init__(width, positions, part, slice)
        self.rank = _check_rank("DiReFTPatch", rank, width)
        self.projection = nn.Linear(width, rank)
        self.up = nn.Parameter(nn.init.orthogonal_(torch.empty(rank, width)))

    def edit(self, h: torch.Tensor) -> torch.Tensor:
        learned = nn.functional.linear(h, self.projection.weight.to(h.dtype), self.projection.bias.to(h.dtype))
        return h + learned @ self.up.to(h.dtype)

    def config(self) -> dict[str, Any]:
        return {**super().config(), "rank": self.rank}


class AddVectorPatch(ReFTPatch):
    """Φ(h) = h + v with a learned v ``[d]`` (zeros at first): the full-vector additive baseline, trained and applied
    at the same positions as a LoReFT patch (d parameters).

    Args:
        width, positions, part, slice: as :class:`ReFTPatch`.
    """

    def __init__(self, width: int, positions: str = "l1", part: Part = "all", slice: Slice = None) -> None:
        super().__init__(width, positions, part, slice)
        self.vector = nn.Parameter(torch.zeros(width))

    def edit(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.vector.to(h.dtype)


class PromptPositionsPatch(Patch):
    """The patch installed by :func:`reft_patch_map`: ``activation[rows, columns] <- Φ(activation[rows, columns])``
    on a ``[batch, seq, d]`` activation.

    Args:
        patch: the ReFT patch.
        rows, columns: ``[N]`` int64 index pairs (row, token column).
        passes: apply during the first ``passes`` forward passes only (1 for the prefill of KV-cache generation),
            ``None`` for every pass.
    """

    requires_clone = False

    def __init__(self, patch: ReFTPatch, rows: torch.Tensor, columns: torch.Tensor, passes: int | None = None) -> None:
        self.slice = None
        self.patch, self.rows, self.columns, self.passes, self.seen = patch, rows, columns, passes, 0

    def op(self, original: torch.Tensor) -> torch.Tensor:
        if self.passes is not None:
            if self.seen >= self.passes:
                return original
            self.seen += 1
        rows, columns = self.rows.to(original.device), self.columns.to(original.device)
        new = self.patch.edit(original[rows, columns])
        return original.index_put((rows, columns), new.to(original.dtype))


def reft_patch_map(patches: Mapping[str, ReFTPatch | Sequence[ReFTPatch]], prompt_lengths: Sequence[int],
                   offsets: Sequence[int] | None = None, passes: int | None = None) -> dict[str, list[Patch]]:
    """The ``pg.patch`` mapping that applies ReFT patches at each row's prompt positions.

    Args:
        patches: NodePath -> ReFT patch(es); each applies at its own ``positions``/``part``.
        prompt_lengths: ``B`` prompt lengths in tokens.
        offsets: per row, the column of its prompt's first token (left padding); default 0 (no padding).
        passes: as :class:`PromptPositionsPatch`.

    Returns:
        NodePath -> patches.

    Raises:
        SubspaceConfigError: a prompt shorter than a patch's positions (before any forward pass).
    """
    starts = list(offsets) if offsets is not None else [0] * len(prompt_lengths)
    mapping: dict[str, list[Patch]] = {}
    for path, spec in patches.items():
        for patch in [spec] if isinstance(spec, ReFTPatch) else list(spec):
            rows, columns = [], []
            for i, (length, start) in enumerate(zip(prompt_lengths, starts)):
                for column in patch.positions.columns(int(length), patch.part):
                    rows.append(i)
                    columns.append(int(start) + column)
            mapping.setdefault(path, []).append(PromptPositionsPatch(
                patch, torch.tensor(rows, dtype=torch.long), torch.tensor(columns, dtype=torch.long), passes))
    return mapping


def prefill_patch_map(patches: Mapping[str, Sequence[Patch]], prompt_lengths: Sequence[int],
                      offsets: Sequence[int] | None = None) -> dict[str, list[Patch]]:
    """For KV-cache generation: ReFT patches at the prompt positions of the prefill pass only; other patches (e.g. a
    steering ``AddPatch``) as they are, at every pass.

    Raises:
        SubspaceConfigError: a prompt shorter than a patch's positions.
    """
    mapping: dict[str, list[Patch]] = {}
    for path, items in patches.items():
        for patch in items:
            if isinstance(patch, ReFTPatch):
                placed = reft_patch_map({path: patch}, prompt_lengths, offsets, passes=1)[path]
                mapping.setdefault(path, []).extend(placed)
            else:
                mapping.setdefault(path, []).append(patch)
    return mapping


def check_saved_reft(directory: str | Path, expected: Mapping[str, Sequence[Patch]]) -> None:
    """Refuse a saved intervention whose ReFT patches differ from ``expected`` (e.g. a training configuration's
    ``Intervention.patch_map()``), naming what differs: node, kind, rank, positions or tying (``part``).

    :meth:`~gradpatch.Intervention.load` then checks the tensors and the model fingerprint.

    Raises:
        InterventionLoadError: an unreadable file, or the first difference (saved value and expected value).
    """
    json_path = Path(directory) / JSON_NAME
    document = read_json(json_path, InterventionLoadError, "save the intervention again with Intervention.save")
    saved = [(r.get("path"), r.get("kind"), r.get("config") or {}) for r in document.get("patches") or []
             if isinstance(r, dict)]
    wanted = [(path, type(p).__name__, p.config() if isinstance(p, ReFTPatch) else {})
              for path, items in expected.items() for p in items]
    if len(saved) != len(wanted):
        raise InterventionLoadError(f"{json_path} holds {len(saved)} patches, this configuration {len(wanted)} "
                                    f"(untied weights are two patches per node, 'first' and 'last'; tied ones one); "
                                    f"load it with the configuration it was trained with")
    for (path, kind, config), (want_path, want_kind, want_config) in zip(saved, wanted):
        if (path, kind) != (want_path, want_kind):
            raise InterventionLoadError(f"{json_path}: saved {kind} at '{path}', but this configuration has "
                                        f"{want_kind} at '{want_path}'")
        for key in ("rank", "positions", "part", "width"):
            if config.get(key) != want_config.get(key):
                raise InterventionLoadError(f"{json_path}: {kind} at '{path}' was saved with {key}="
                                            f"{config.get(key)!r}, but this configuration has {key}="
                                            f"{want_config.get(key)!r}; load it with the {key} it was trained with")


TRAINABLE_KINDS.update({cls.__name__: cls for cls in (LoReFTPatch, DiReFTPatch, AddVectorPatch)})
