"""The exact activation-patching sweep: the metric with one activation replaced, for every unit, batched.

Each patched variant is one copy of the base prompts along the batch dimension, so one forward pass of
``variants * batch`` rows scores ``variants`` units (Meng et al. 2022 batch their causal-tracing restorations the
same way). Blocks before the earliest patched block compute the same values in every variant, so for Llama-style and
GPT-2 models the pass runs them on the base prompts once and repeats the rows at that block's input. The score of a unit is ``M(base with the unit's source value) − M(base)``: noising (the default) runs the
clean prompts with one corrupted activation; denoising runs the corrupted prompts with one clean activation (Heimersheim
& Nanda 2024, "How to use and interpret activation patching").
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..errors import NodePathError
from ..patchable_graph import PatchableGraph
from ..patches import CustomPatch
from .errors import AttributionError
from .metrics import Metric, logit_difference
from .nodes import Node, Unit, as_nodes, detect_family, units
from .prompts import PromptBatch
from .records import AttributionResult, NodeScore
from .runner import Progress, Runner, check_positions

__all__ = ["block_inputs", "exact_sweep", "variant_patches"]


def block_inputs(pg: PatchableGraph, nodes: Sequence[Node]) -> dict[int, str] | None:
    """Block index -> NodePath of the block's input (``model.layers_N.hidden_states``), for the blocks of
    ``nodes``; ``None`` when a node has no block or the graph is not a known family (no rows are then shared)."""
    layers = {node.layer for node in nodes}
    if None in layers or any(node.kind == "node" for node in nodes):
        return None
    try:
        family = detect_family(pg)
        paths = {layer: f"{family.layer.format(layer)}.hidden_states" for layer in layers}
        for path in paths.values():
            pg.node(path)
    except (AttributionError, NodePathError):
        return None
    return paths  # type: ignore[return-value]


def _repeat_rows(copies: int) -> CustomPatch:
    def op(value: torch.Tensor) -> torch.Tensor:
        return value.repeat(copies, *([1] * (value.dim() - 1)))

    return CustomPatch(custom_op=op, requires_clone=False)


def variant_patches(chunk: Sequence[Unit], rows: int, source: Mapping[str, torch.Tensor]) -> dict[str, CustomPatch]:
    """The patches that give row block ``v`` (rows ``v*rows`` to ``(v+1)*rows``) of a ``len(chunk) * rows`` batch the
    source value of unit ``chunk[v]`` and leave every other block alone.

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
            blocks = flat.reshape(mask.shape[0], rows, *flat.shape[1:])
            patched = torch.where(mask, value.to(activation.dtype).unsqueeze(0), blocks).reshape(flat.shape)
            return node.unflat(patched)

        return CustomPatch(custom_op=op, requires_clone=False)

    return {path: replace(path, mask) for path, mask in masks.items()}


def exact_sweep(pg: PatchableGraph, batch: PromptBatch, nodes: str | Sequence[str] | Sequence[Node] = "all",
                metric: Metric = logit_difference, *, positions: Sequence[int] | None = None,
                direction: str = "noise", batch_size: int = 32, forward_kwargs: Mapping[str, Any] | None = None,
                progress: Progress | None = None, share_prefix: bool = True) -> AttributionResult:
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
        share_prefix: run the blocks before a pass's first patched block once, on the base rows (Llama-style and
            GPT-2 kinds); ``False`` runs every variant's whole forward (the same scores, for comparisons).

    Returns:
        An :class:`AttributionResult` with one :class:`NodeScore` per unit; passes = 2 + ceil(units / variants).

    Raises:
        AttributionError: bad nodes, positions, direction, metric or batch size (before any forward pass).
    """
    start = time.perf_counter()
    resolved = as_nodes(pg, nodes)
    chosen = check_positions(positions, batch.length)
    if batch_size < 1:
        raise AttributionError(f"batch_size={batch_size}: give at least 1 row per forward pass")
    runner = Runner(pg, batch, metric, direction, forward_kwargs)
    clean_acts, m_clean = runner.record(batch.clean, resolved)
    corrupted_acts, m_corrupted = runner.record(batch.corrupted, resolved)
    source, base_value = (corrupted_acts, m_clean) if direction == "noise" else (clean_acts, m_corrupted)
    del clean_acts, corrupted_acts
    todo = units(resolved, chosen)
    per_pass = max(1, batch_size // batch.size)
    starts = block_inputs(pg, resolved) if share_prefix else None
    scores: list[NodeScore] = []
    with torch.no_grad():
        for first in range(0, len(todo), per_pass):
            chunk = todo[first:first + per_pass]
            patches: dict[str, Any] = dict(variant_patches(chunk, batch.size, source))
            if starts is None:
                ids = runner.base_ids.repeat(len(chunk), 1)
            else:  # the blocks before the first patched one run once, on the base rows
                ids = runner.base_ids
                patches[starts[min(unit.node.layer for unit in chunk)]] = _repeat_rows(len(chunk))  # type: ignore
            logits = runner.logits(ids, patches)
            for v, unit in enumerate(chunk):
                value = float(runner.value(logits[v * batch.size:(v + 1) * batch.size]))
                scores.append(NodeScore(unit.node.path, unit.position, unit.head, value - base_value, unit.node.kind,
                                        unit.node.layer))
            if progress is not None:
                progress(first + len(chunk), len(todo))
    return AttributionResult("exact", direction, m_clean, m_corrupted, forward=runner.forwards, backward=0,
                             seconds=time.perf_counter() - start, scores=scores)

