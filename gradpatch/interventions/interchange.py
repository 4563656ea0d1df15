"""Interchange interventions: run source and base inputs in one forward pass, with trainable patches that replace
(a subspace of) the base activation at chosen positions by the source activation there.

The rows of one batch are the base inputs followed by each source's inputs (left-padded together). At a patched
node the activation ``[rows, seq, d]`` holds every row's value; rows do not interact, so the source rows' values
at that node are exactly what a separate source run records. The patch reads them (detached: no gradient reaches
the source run) at the source positions and writes ``patch.intervene(base, source)`` into the base rows at the base
positions. Gradients reach the patch parameters through the base rows only (Geiger et al. 2023, interchange
intervention training). A forward costs ``(1 + n_sources) · batch`` rows instead of two runs. With
``shared_batch=False`` each source instead runs first, without gradients and only up to the last patched node, and
the base run reads what it recorded (cheaper in training when the patched nodes are early: the source rows then skip
the later layers and the backward pass).

Positions, per example (:func:`token_positions`): an index into the prompt's tokens (negative counts from the end),
``"last"``, the last token of a named subject, or ``None`` for every position (base and source of equal length).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Union

import torch
from torch import nn

from ..errors import SubspaceConfigError
from ..model_io import call_left_padded, left_pad
from ..patches import Patch
from .subspace import TrainablePatch

__all__ = ["InterchangeSide", "Position", "check_interchange_node", "check_sides", "interchange", "interchange_logits",
           "interchange_patch_map", "last_token_of", "token_positions"]

#: Where to intervene in one prompt: an index (negative from the end), ``"last"``, or ``None`` (every token).
Position = Union[int, str, None]


def last_token_of(tokenizer: Any, prompt: str, subject: str) -> int:
    """Index of the last token of the last occurrence of ``subject`` in ``prompt`` (tokenized as
    ``tokenizer(prompt)`` tokenizes it; a fast tokenizer's offsets map characters to tokens).

    Raises:
        SubspaceConfigError: ``subject`` does not occur in ``prompt``, or no token covers its end.
    """
    start = prompt.rfind(subject) if subject else -1
    if start < 0:
        raise SubspaceConfigError(f"subject {subject!r} is not in prompt {prompt!r}: give the subject as it is "
                                  f"written in the prompt (case and spaces included)")
    end = start + len(subject)
    offsets = tokenizer(prompt, return_offsets_mapping=True, add_special_tokens=False)["offset_mapping"]
    covering = [i for i, (low, high) in enumerate(offsets) if low < end and high > start]
    if not covering:
        raise SubspaceConfigError(f"no token of {prompt!r} covers subject {subject!r}")
    return covering[-1]


def token_positions(length: int, position: Position) -> list[int]:
    """Non-negative token indices of one prompt of ``length`` tokens for ``position``.

    Raises:
        SubspaceConfigError: an index outside the prompt, or an unknown name.
    """
    if position is None:
        return list(range(length))
    if position == "last":
        return [length - 1]
    if isinstance(position, int) and not isinstance(position, bool) and -length <= position < length:
        return [position % length]
    raise SubspaceConfigError(f"position {position!r} does not fit a prompt of {length} tokens: use an index in "
                              f"{-length}..{length - 1}, 'last', a subject, or None for every token")


@dataclass
class InterchangeSide:
    """One side (base, or one source) of an interchange batch: token ids per row and the positions to patch.

    Attributes:
        input_ids: ``B`` lists of token ids (unpadded).
        positions: per row, token indices (non-negative, into that row's ids), the same number ``P`` in every row;
            an empty list means every token (base and source rows of equal length).
    """

    input_ids: list[list[int]]
    positions: list[list[int]] = field(default_factory=list)

    @classmethod
    def encode(cls, tokenizer: Any, prompts: Sequence[str], positions: Sequence[Position] | Position = "last",
               subjects: Sequence[str | None] | None = None) -> "InterchangeSide":
        """Tokenize ``prompts`` (no special tokens) and resolve each row's position: the subject's last token when
        ``subjects[i]`` is given, else ``positions`` (one for all rows or one per row).

        Raises:
            SubspaceConfigError: a subject missing from its prompt, an index outside its prompt, an empty prompt.
        """
        ids = [list(tokenizer(p, add_special_tokens=False)["input_ids"]) for p in prompts]
        for prompt, row in zip(prompts, ids):
            if not row:
                raise SubspaceConfigError(f"prompt {prompt!r} has no tokens")
        each = list(positions) if isinstance(positions, (list, tuple)) else [positions] * len(ids)
        rows = []
        for i, row in enumerate(ids):
            subject = subjects[i] if subjects is not None else None
            if subject is not None:
                rows.append([last_token_of(tokenizer, prompts[i], subject)])
            elif each[i] is None:
                rows.append([])
            else:
                rows.append(token_positions(len(row), each[i]))
        return cls(ids, rows)


def check_interchange_node(pg: Any, path: str, patch: Patch | None = None) -> int:
    """Check that the node at ``path`` holds a ``[batch, seq, d]`` activation (and that ``patch`` has width ``d``).

    Returns:
        ``d``.

    Raises:
        SubspaceConfigError: another shape, or a trainable patch of another width.
        NodePathError: unknown NodePath.
    """
    shape = pg.node(path).tensor_shape
    if shape is None or len(shape) != 3:
        raise SubspaceConfigError(f"interchange at '{path}': the activation there is "
                                  f"{'not a tensor' if shape is None else f'of shape {tuple(shape)}'}, not "
                                  f"[batch, seq, d]; patch a residual stream or a module output such as "
                                  f"'model.layers_5.output|sub_0' or 'model.layers_5.mlp.output'")
    if isinstance(patch, TrainablePatch):
        patch.check_width(int(shape[-1]), path)
    return int(shape[-1])


class _Interchange(Patch):
    """The patch installed during :func:`interchange`: base rows at base columns <- intervene(base, source), the
    source read from the same activation (rows and columns) or given as a tensor recorded in a source pass."""

    requires_clone = False

    def __init__(self, patch: TrainablePatch, base: tuple[torch.Tensor, torch.Tensor],
                 source: tuple[torch.Tensor, torch.Tensor] | torch.Tensor) -> None:
        self.slice = None
        self.patch, self.base, self.source = patch, base, source

    def op(self, original: torch.Tensor) -> torch.Tensor:
        rows, cols = (t.to(original.device) for t in self.base)
        if isinstance(self.source, torch.Tensor):
            source = self.source.to(device=original.device, dtype=original.dtype)
        else:
            source = original[tuple(t.to(original.device) for t in self.source)].detach()
        new = self.patch.intervene(original[rows, cols], source)
        return original.index_put((rows, cols), new.to(original.dtype))


class _StopForward(Exception):
    """Raised by :class:`_Recorder` once every patched node of a source pass is recorded: the rest of the source
    forward pass is never computed."""


class _Recorder(Patch):
    """Records ``activation[rows, cols]`` (detached) at its node into ``store``; stops the pass when ``store`` holds
    ``expected`` entries."""

    requires_clone = False

    def __init__(self, path: str, at: tuple[torch.Tensor, torch.Tensor], store: dict[str, torch.Tensor],
                 expected: int) -> None:
        self.slice = None
        self.path, self.at, self.store, self.expected = path, at, store, expected

    def op(self, original: torch.Tensor) -> torch.Tensor:
        if self.path not in self.store:
            self.store[self.path] = original[tuple(t.to(original.device) for t in self.at)].detach()
        if len(self.store) == self.expected:
            raise _StopForward
        return original


def _padded(sides: Sequence[InterchangeSide], pad_id: int) -> tuple[dict[str, torch.Tensor], list[torch.Tensor]]:
    """Left-padded ``input_ids``, ``attention_mask``, ``position_ids`` ``[rows, S]`` of all sides' rows, and per
    side the column of each position ``[B, P]``."""
    batch = left_pad([row for side in sides for row in side.input_ids], pad_id)
    width = batch["input_ids"].shape[1]
    columns = []
    for side in sides:
        if all(not p for p in side.positions):
            columns.append(torch.arange(width).expand(len(side.input_ids), width))
        else:
            columns.append(torch.tensor([[width - len(row) + p for p in pos]
                                         for row, pos in zip(side.input_ids, side.positions)], dtype=torch.long))
    return batch, columns


def check_sides(base: InterchangeSide, sources: Sequence[InterchangeSide]) -> None:
    """Raise :class:`SubspaceConfigError` unless every source has the base's rows and matching positions."""
    for j, source in enumerate(sources):
        if len(source.input_ids) != len(base.input_ids):
            raise SubspaceConfigError(f"source {j} has {len(source.input_ids)} rows and the base "
                                      f"{len(base.input_ids)}: give one source prompt per base prompt")
        for i, (b, s, bp, sp) in enumerate(zip(base.input_ids, source.input_ids, base.positions, source.positions)):
            if (not bp or not sp) and (bp or sp or len(b) != len(s)):
                raise SubspaceConfigError(
                    f"row {i}: base of {len(b)} tokens and source {j} of {len(s)} tokens without positions on "
                    f"both sides; give base_position/source_position (an index, 'last') or subjects")
            if len(bp) != len(sp):
                raise SubspaceConfigError(f"row {i}: {len(bp)} base positions but {len(sp)} source positions; give "
                                          f"as many on both sides")
    counts = {len(p) for p in base.positions}
    if len(counts) > 1:
        raise SubspaceConfigError(f"base rows have different numbers of positions {sorted(counts)}; use one each")


def interchange_patch_map(pg: Any, patches: Mapping[str, TrainablePatch | Sequence[TrainablePatch]],
                          columns: Sequence[torch.Tensor], source_of: Mapping[str, int] | None = None
                          ) -> dict[str, list[Patch]]:
    """The patch map of an interchange over a batch laid out as ``B`` base rows followed by ``B`` rows per source.

    For any model whose patched nodes are ``[rows, seq, d]`` (a language model, or an MLP run on ``[rows, 1, d]``
    inputs): ``with pg.patch(interchange_patch_map(...)): pg(batch)``. :func:`interchange` builds the batch and the
    columns for token inputs.

    Args:
        pg: the :class:`~gradpatch.PatchableGraph`.
        patches: NodePath -> trainable patch(es).
        columns: ``[B, P]`` columns (token positions in the batch) of the base rows, then of each source's rows.
        source_of: NodePath -> index of the source its patches read (default 0).

    Raises:
        SubspaceConfigError: a node that is not ``[batch, seq, d]``, a patch of the wrong width, an unknown source
            index, columns of different shapes.
        NodePathError: unknown NodePath.
    """
    count = int(columns[0].shape[0])
    if any(tuple(c.shape) != tuple(columns[0].shape) for c in columns):
        raise SubspaceConfigError(f"base and source columns have shapes {[tuple(c.shape) for c in columns]}; give "
                                  f"every side the same [rows, positions] shape")
    rows = torch.arange(count)[:, None].expand_as(columns[0])
    mapping: dict[str, list[Patch]] = {}
    for path, spec in patches.items():
        index = dict(source_of or {}).get(path, 0)
        if not 0 <= index < len(columns) - 1:
            raise SubspaceConfigError(f"source_of['{path}'] = {index}, but there are {len(columns) - 1} sources")
        for patch in [spec] if isinstance(spec, TrainablePatch) else list(spec):
            check_interchange_node(pg, path, patch)
            source_at = (rows + count * (1 + index), columns[1 + index])
            mapping.setdefault(path, []).append(_Interchange(patch, (rows, columns[0]), source_at))
    return mapping


def interchange(pg: nn.Module, patches: Mapping[str, TrainablePatch | Sequence[TrainablePatch]],
                base: InterchangeSide, sources: InterchangeSide | Sequence[InterchangeSide], pad_id: int,
                source_of: Mapping[str, int] | None = None, shared_batch: bool = True, **call_kwargs: Any) -> Any:
    """Run an interchange intervention on token inputs, every patch applied to the base rows.

    With ``shared_batch`` (the default) base and sources go in one left-padded batch and one forward pass. Without
    it, each source runs first without gradients and only up to the last patched node (the rest of its forward pass
    is skipped), recording its activations at the source positions; then the base runs with the patches reading
    them. Both give the same base outputs (tested); the second costs less when the patched nodes are early, since
    the shared batch carries the source rows through every layer and through the backward pass.

    Args:
        pg: a :class:`~gradpatch.PatchableGraph` of a model called as ``pg(input_ids, attention_mask=,
            position_ids=, **call_kwargs)`` (a causal LM built with those example inputs).
        patches: NodePath -> trainable patch(es); each node's activation must be ``[batch, seq, d]``.
        base: the base rows (``B`` prompts) and positions.
        sources: one or several sources, each ``B`` rows (source ``j`` row ``i`` goes with base row ``i``).
        pad_id: the padding token id.
        source_of: NodePath -> index of the source its patches read (default 0).
        shared_batch: one forward pass for base and sources (``True``) or a truncated source pass first.
        call_kwargs: other arguments of every call (e.g. ``use_cache=False``).

    Returns:
        The model's output with the base rows first (``B · (1 + n_sources)`` rows with ``shared_batch``, ``B``
        without); :func:`interchange_logits` takes the base rows' logits.

    Raises:
        SubspaceConfigError: a node that is not ``[batch, seq, d]``, a patch of the wrong width, sources of another
            row count, base and source of different lengths without positions, different position counts, an
            unknown source index. All before any forward pass.
        NodePathError: unknown NodePath.
    """
    sources = [sources] if isinstance(sources, InterchangeSide) else list(sources)
    check_sides(base, sources)

    if shared_batch:
        batch, columns = _padded([base, *sources], pad_id)
        with pg.patch(interchange_patch_map(pg, patches, columns, source_of)):
            return call_left_padded(pg, batch, **call_kwargs)
    base_batch, (base_columns,) = _padded([base], pad_id)
    checked = interchange_patch_map(pg, patches, [base_columns] * (1 + len(sources)), source_of)  # checks only
    rows = torch.arange(len(base.input_ids))[:, None].expand_as(base_columns)
    recorded: list[dict[str, torch.Tensor]] = []
    for j, source in enumerate(sources):
        source_batch, (source_columns,) = _padded([source], pad_id)
        paths = [path for path in checked if dict(source_of or {}).get(path, 0) == j]
        store: dict[str, torch.Tensor] = {}
        recorders = {path: _Recorder(path, (rows, source_columns), store, len(paths)) for path in paths}
        if recorders:
            with torch.no_grad(), pg.patch(recorders):
                try:
                    call_left_padded(pg, source_batch, **call_kwargs)
                except _StopForward:
                    pass
        recorded.append(store)
    mapping = {path: [_Interchange(entry.patch, (rows, base_columns),
                                   recorded[dict(source_of or {}).get(path, 0)][path]) for entry in entries]
               for path, entries in checked.items()}
    with pg.patch(mapping):
        return call_left_padded(pg, base_batch, **call_kwargs)


def interchange_logits(output: Any, base_rows: int) -> torch.Tensor:
    """The logits of the base rows from :func:`interchange`'s output: ``[B, S', V]``."""
    logits = output.logits if hasattr(output, "logits") else output[0] if isinstance(output, tuple) else output
    return logits[:base_rows]
