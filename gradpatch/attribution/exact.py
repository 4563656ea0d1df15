"""The exact activation-patching sweep: the metric with one activation replaced, for every unit, batched.

Each patched variant is one copy of the base prompts along the batch dimension, so one forward pass of
``variants * batch`` rows scores ``variants`` units (Meng et al. 2022 batch their causal-tracing restorations the
same way). Two savings make a pass do less arithmetic than one forward per variant, both exact in a causal model:
blocks before the pass's earliest patched block compute the same values in every variant, so for Llama-style and
GPT-2 models the pass runs them on the base prompts once and repeats the rows at that block's input; and positions
before the patched one are the base run's at every layer, so the variants patched at position ``p`` run only tokens
``[p, end)`` on the base run's KV cache (:mod:`gradpatch.attribution.suffix`). The score of a unit is
``M(base with the unit's source value) − M(base)``: noising (the default) runs the clean prompts with one corrupted
activation; denoising runs the corrupted prompts with one clean activation (Heimersheim & Nanda 2024, "How to use and
interpret activation patching").
"""

from __future__ import annotations

import time
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import torch

from ..layouts import has_node
from ..model_io import model_dtype
from ..patchable_graph import PatchableGraph
from ..patches import CustomPatch
from .errors import AttributionError
from .metrics import Metric, logit_difference
from .nodes import Node, Unit, as_nodes, detect_family, units
from .prompts import PromptBatch
from .records import AttributionResult, NodeScore
from .runner import Progress, Runner, check_positions
from .suffix import PositionPrefix, position_prefix, quiet_extraction, repeat_rows, same_metric

__all__ = ["block_inputs", "exact_sweep", "variant_patches"]


def block_inputs(pg: PatchableGraph, nodes: Sequence[Node]) -> dict[int, str] | None:
    """Block index -> NodePath of the block's input (``model.layers_N.hidden_states``), for the blocks of
    ``nodes``; ``None`` when a node has no block or the graph is not a known family (no rows are then shared)."""
    layers = {node.layer for node in nodes}
    if None in layers or any(node.kind == "node" for node in nodes):
        return None
    try:
        family = detect_family(pg)
    except AttributionError:
        return None
    paths = {layer: family.path("block_input", layer) for layer in layers}  # type: ignore[arg-type]
    return paths if all(has_node(pg, path) for path in paths.values()) else None


def _blocks_shared(runner: Runner, starts: Mapping[int, str], base_value: float) -> bool:
    """Whether, in whole-prompt passes, the base rows can run the blocks before the earliest patched one and be
    repeated there: one whole pass
    of the base prompts split that way into two copies must give the base metric in both. It fails where the
    blocks take a value of the base rows' batch size besides the hidden states (an attention mask materialised by
    eager attention or a sliding window, ``[rows, 1, seq, seq]``); the sweep then runs every block on every row."""
    rows = runner.batch.size
    try:
        with torch.no_grad():
            logits = runner.logits(runner.base_ids, {starts[min(starts)]: repeat_rows(2)})
            values = [float(runner.value(logits[c * rows:(c + 1) * rows])) for c in (0, 1)]
    except RuntimeError:  # the batch sizes do not broadcast
        return False
    return all(same_metric(value, base_value, model_dtype(runner.pg)) for value in values)


def variant_patches(chunk: Sequence[Unit], rows: int, source: Mapping[str, torch.Tensor]) -> dict[str, CustomPatch]:
    """The patches that give row block ``v`` (rows ``v*rows`` to ``(v+1)*rows``) of a ``len(chunk) * rows`` batch the
    source value of unit ``chunk[v]`` and leave every other block alone.

    A pass may run only the last tokens of the prompts (a suffix pass on a KV cache): an activation of ``s < seq``
    positions holds positions ``seq - s`` to ``seq - 1``, and the patch indexes it accordingly.

    Args:
        chunk: one unit per variant.
        rows: prompts per variant (the base batch size).
        source: NodePath -> source activation ``[rows, seq, width]`` (:meth:`Node.flat`).
    """
    masks: dict[str, torch.Tensor] = {}
    nodes = {unit.node.path: unit.node for unit in chunk}
    for v, unit in enumerate(chunk):
        value = source[unit.node.path]
        mask = masks.setdefault(unit.node.path, torch.zeros(len(chunk), 1, *value.shape[1:], dtype=torch.bool,
                                                             device=value.device))
        mask[v, 0, unit.position, unit.features()] = True

    def replace(path: str, mask: torch.Tensor) -> CustomPatch:
        value, node = source[path], nodes[path]

        def op(activation: torch.Tensor) -> torch.Tensor:
            flat = node.flat(activation)
            offset = value.shape[1] - flat.shape[1]  # positions before the pass's first token (cached)
            blocks = flat.reshape(mask.shape[0], rows, *flat.shape[1:])
            patched = torch.where(mask[:, :, offset:], value[:, offset:].to(activation.dtype).unsqueeze(0), blocks)
            return node.unflat(patched.reshape(flat.shape))

        return CustomPatch(custom_op=op, requires_clone=False)

    return {path: replace(path, mask) for path, mask in masks.items()}


def _passes(todo: Sequence[Unit], per_pass: int, by_position: bool) -> list[tuple[int, list[int]]]:
    """``(prefix, unit indices)`` of each pass of at most ``per_pass`` units: in order (prefix 0) or, ``by_position``,
    the units of one position together (prefix = that position), each position's units sorted by block so that a
    pass's earliest patched block is as late as it can be."""
    if not by_position:
        indices = list(range(len(todo)))
        return [(0, indices[first:first + per_pass]) for first in range(0, len(todo), per_pass)]
    groups: dict[int, list[int]] = {}
    for index, unit in enumerate(todo):
        groups.setdefault(unit.position, []).append(index)
    passes = []
    for position in sorted(groups):
        group = sorted(groups[position], key=lambda index: todo[index].node.layer or 0)
        passes += [(position, group[first:first + per_pass]) for first in range(0, len(group), per_pass)]
    return passes


def _selected(every: Sequence[Unit], only: Collection[tuple[str, int, int | None]]) -> list[Unit]:
    """The units of ``every`` whose ``(NodePath, position, head)`` is in ``only``, in the order of ``every``."""
    keys = set(only)
    chosen = [unit for unit in every if (unit.node.path, unit.position, unit.head) in keys]
    missing = keys - {(unit.node.path, unit.position, unit.head) for unit in chosen}
    if missing:
        raise AttributionError(f"{len(missing)} unit(s) to patch are not units of the nodes and positions given, e.g. "
                               f"{sorted(missing, key=str)[0]}: pass the nodes and positions the scores came from")
    if not chosen:
        raise AttributionError("no units to patch: give at least one (NodePath, position, head) key")
    return chosen


def exact_sweep(pg: PatchableGraph, batch: PromptBatch, nodes: str | Sequence[str] | Sequence[Node] = "all",
                metric: Metric = logit_difference, *, positions: Sequence[int] | None = None,
                direction: str = "noise", batch_size: int = 32, forward_kwargs: Mapping[str, Any] | None = None,
                progress: Progress | None = None, share_prefix: bool = True,
                only: Collection[tuple[str, int, int | None]] | None = None) -> AttributionResult:
    """Activation patching at every unit (node, position[, head]): the exact effect every estimate is checked against.

    Args:
        pg: the model's graph.
        batch: prompt pairs ``[batch, seq]`` (one token length).
        nodes: node kinds (``"resid"``, ``"heads"``, ``"mlp"``, ``"all"``), NodePaths, or resolved :class:`Node`\\ s.
        metric: ``metric(logits [batch, vocab], batch) -> scalar`` (default: the mean logit difference).
        positions: 0-based positions to patch (default: all).
        direction: ``"noise"`` or ``"denoise"``.
        batch_size: rows per forward pass; ``max(1, batch_size // batch.size)`` variants run at once.
        forward_kwargs: keyword arguments of every call of ``pg`` (those it was built with).
        progress: ``progress(done, total)`` over units.
        share_prefix: compute once what the variants share: the blocks before a pass's first patched block run on the
            base rows (Llama-style and GPT-2 kinds), and the variants patched at position ``p`` run tokens
            ``[p, end)`` on the base run's KV cache (models whose ``forward`` takes a transformers cache, checked
            first: :func:`~gradpatch.attribution.suffix.position_prefix`); ``False`` runs every variant's whole
            forward over the whole prompt (the same scores, for comparisons).
        only: patch only these units, as ``(NodePath, position, head)`` keys (``head`` ``None`` except for heads,
            queries and keys) of ``nodes`` at ``positions``: the verification of an estimate's top units
            (:func:`~gradpatch.attribution.verify.verify_top`).

    Returns:
        An :class:`AttributionResult` with one :class:`NodeScore` per unit, in the order of
        :func:`~gradpatch.attribution.nodes.units`. Passes: 2 recordings + ceil(units / variants) without the cache;
        with it 2 recordings + 1 pass filling the cache + 1 to 3 checks of it + ceil(units at p / variants) per position
        ``p`` > 0, each of ``seq - p`` tokens (``forward_tokens`` sums the tokens of every pass); 1 more (a check) where
        blocks are shared in whole-prompt passes (no cache, or position 0 patched).

    Raises:
        AttributionError: bad nodes, positions, direction, metric or batch size, a key of ``only`` that is no unit of
            ``nodes`` at ``positions`` (before any forward pass).
    """
    start = time.perf_counter()
    resolved = as_nodes(pg, nodes)
    chosen = check_positions(positions, batch.length)
    if batch_size < 1:
        raise AttributionError(f"batch_size={batch_size}: give at least 1 row per forward pass")
    todo = units(resolved, chosen) if only is None else _selected(units(resolved, chosen), only)
    runner = Runner(pg, batch, metric, direction, forward_kwargs)
    clean_acts, m_clean = runner.record(batch.clean, resolved)
    corrupted_acts, m_corrupted = runner.record(batch.corrupted, resolved)
    source, base_value = (corrupted_acts, m_clean) if direction == "noise" else (clean_acts, m_corrupted)
    del clean_acts, corrupted_acts
    per_pass = max(1, batch_size // batch.size)
    prefix: PositionPrefix | None = position_prefix(runner, chosen, base_value) if share_prefix else None
    starts = block_inputs(pg, resolved) if share_prefix else None
    whole_passes = prefix is None or 0 in chosen  # the suffix passes' own mask broadcasts over base and variant rows
    if starts is not None and whole_passes and not _blocks_shared(runner, starts, base_value):
        starts = None
    values: dict[int, float] = {}
    with torch.no_grad(), quiet_extraction():
        for cached, indices in _passes(todo, per_pass, prefix is not None):
            chunk = [todo[index] for index in indices]
            patches: dict[str, Any] = dict(variant_patches(chunk, batch.size, source))
            layer = 0
            if starts is None:
                ids = runner.base_ids.repeat(len(chunk), 1)
            else:  # the blocks before the first patched one run once, on the base rows
                ids, layer = runner.base_ids, min(unit.node.layer for unit in chunk)  # type: ignore[type-var]
                patches[starts[layer]] = repeat_rows(len(chunk))
            call = None if prefix is None or cached == 0 else prefix.call_kwargs(cached, len(chunk), layer)
            logits = runner.logits(ids[:, cached:], patches, call)
            for v, index in enumerate(indices):
                values[index] = float(runner.value(logits[v * batch.size:(v + 1) * batch.size]))
            if progress is not None:
                progress(len(values), len(todo))
    scores = [NodeScore(unit.node.path, unit.position, unit.head, values[index] - base_value, unit.node.kind,
                        unit.node.layer, exact=True) for index, unit in enumerate(todo)]
    return AttributionResult("exact", direction, m_clean, m_corrupted, forward=runner.forwards, backward=0,
                             seconds=time.perf_counter() - start, scores=scores, forward_tokens=runner.forward_tokens)
