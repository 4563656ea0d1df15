"""Attribution patching (AtP): the first-order estimate of every unit's patching effect from one backward pass.

score(n) = (a_n^source − a_n^base) · ∂M/∂a_n |_base (Nanda 2023, "Attribution patching: activation patching at
industrial scale"; Kramár et al. 2024, arXiv 2403.00745, eq. 3). The gradient ∂M/∂a_n of every node at once is the
gradient of a zero ``AddPatch`` parameter ``[batch, seq, width]`` added at the node; for heads the dot product is
taken over the head's slice of the width. Costs two forward passes (source, base) and one backward pass.

AtP-IG (``steps=m``): the gradient is averaged over m runs of the base prompt whose token embeddings are interpolated,
e_source + (k/m)(e_base − e_source) for k = 1..m (integrated gradients along the input path, the "inputs" variant that
Hanna et al. 2024, arXiv 2403.17806, section 3, use for EAP-IG; Marks et al. 2024, arXiv 2403.19647, section 2, use
IG for node effects). score(n) = (a_n^source − a_n^base) · (1/m) Σ_k ∂M/∂a_n |_k. Where a node's source and base
values lie in different regions of a nonlinearity (AtP's failure, Kramár et al. section 3.1) the averaged gradient
sees the path between them. Costs 1 + m forward and m backward passes.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ..errors import NonFiniteError
from ..patchable_graph import PatchableGraph
from ..patches import AddPatch, ProbePatch, ReplacePatch
from .errors import AttributionError
from .metrics import Metric, logit_difference
from .nodes import Node, as_nodes, detect_family, resolve_nodes, units
from .prompts import PromptBatch
from .records import AttributionResult, NodeScore
from .runner import Runner, check_positions

__all__ = ["atp", "head_totals", "node_gradients", "unit_scores"]


def node_gradients(runner: Runner, ids: torch.Tensor, nodes: Sequence[Node], extra: Mapping[str, Any] | None = None,
                   after: bool = False) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], float]:
    """One forward and one backward pass of ``ids``: every node's value and ∂M/∂value, both as ``[batch, seq, width]``
    (:meth:`Node.flat`), and the metric.

    Args:
        extra: more patches for the pass.
        after: apply ``extra`` after the gradient probes at the same node (so a patch that stops the gradient there
            stops it for the node too) instead of before them.

    Raises:
        NonFiniteError: a gradient holds NaN or ±inf (naming the node).
    """
    probes = {node.path: ProbePatch() for node in nodes}
    zeros = {node.path: nn.Parameter(node.unflat(torch.zeros(ids.shape[0], ids.shape[1], node.width,
                                                             device=ids.device)).contiguous()) for node in nodes}
    patch_map: dict[str, Any] = {path: [probes[path], AddPatch(value=zero)] for path, zero in zeros.items()}
    for path, patch in (extra or {}).items():
        own = patch_map.get(path, [])
        patch_map[path] = [*own, patch] if after else [patch, *own]
    with torch.enable_grad():
        value = runner.value(runner.logits(ids, patch_map))
        grads = torch.autograd.grad(value, list(zeros.values()), allow_unused=True)
    runner.backwards += 1
    gradients = {}
    for node, grad in zip(nodes, grads):
        grad = torch.zeros_like(zeros[node.path]) if grad is None else grad
        if not bool(torch.isfinite(grad).all()):
            raise NonFiniteError(f"the gradient of the metric at node '{node.path}' holds NaN or ±inf; check the "
                                 f"metric (a log of a zero probability?) and the model's dtype (run in float32)")
        gradients[node.path] = node.flat(grad)
    return ({node.path: node.flat(probes[node.path].activation) for node in nodes}, gradients,
            float(value.detach()))


def head_totals(node: Node, product: torch.Tensor) -> torch.Tensor:
    """``product`` ``[batch, seq, width]`` summed over each unit's features: ``[batch, seq, n_heads]`` for nodes with
    heads, ``[batch, seq, 1]`` otherwise."""
    return product.reshape(*product.shape[:2], node.n_heads or 1, -1).sum(-1)


def unit_scores(nodes: Sequence[Node], positions: Sequence[int],
                totals: Mapping[str, torch.Tensor]) -> list[NodeScore]:
    """Records from per-node totals ``[batch, seq, n_heads or 1]`` (:func:`head_totals`), summed over the batch."""
    sums = {path: total.sum(0) for path, total in totals.items()}  # [seq, heads]
    scores = []
    for unit in units(nodes, positions):
        value = float(sums[unit.node.path][unit.position, unit.head or 0])
        scores.append(NodeScore(unit.node.path, unit.position, unit.head, value, unit.node.kind, unit.node.layer))
    return scores


def atp(pg: PatchableGraph, batch: PromptBatch, nodes: str | Sequence[str] | Sequence[Node] = "all",
        metric: Metric = logit_difference, *, positions: Sequence[int] | None = None, direction: str = "noise",
        steps: int = 0, forward_kwargs: Mapping[str, Any] | None = None) -> AttributionResult:
    """AtP scores of every unit (node, position[, head]) from two forwards and one backward, or AtP-IG scores
    (``steps=m``: the gradient averaged over m runs with interpolated token embeddings; 1 + m forwards, m backwards).

    Args:
        pg, batch, nodes, metric, positions, direction, forward_kwargs: as for
            :func:`~gradpatch.attribution.exact.exact_sweep`.
        steps: 0 for AtP; m ≥ 1 interpolation steps for AtP-IG (needs a Llama-style or GPT-2 graph, whose token
            embeddings it interpolates).

    Returns:
        An :class:`AttributionResult` (method ``"atp"`` or ``"atp-ig"``), scores in the metric's units.

    Raises:
        AttributionError: bad nodes, positions, direction, metric or ``steps``, or AtP-IG on a graph whose token
            embeddings are unknown (before any forward pass).
        NonFiniteError: a non-finite gradient, naming the node.
    """
    start = time.perf_counter()
    if steps < 0:
        raise AttributionError(f"steps={steps}: give 0 (AtP) or the number of AtP-IG interpolation steps (e.g. 5)")
    resolved = as_nodes(pg, nodes)
    chosen = check_positions(positions, batch.length)
    embed = resolve_nodes(pg, [detect_family(pg).embed])[0] if steps else None
    runner = Runner(pg, batch, metric, direction, forward_kwargs)
    recorded = resolved if embed is None or any(node.path == embed.path for node in resolved) else [*resolved, embed]
    source, m_source = runner.record(runner.source_ids, recorded)
    base, grads, m_base = node_gradients(runner, runner.base_ids, recorded)  # AtP, or AtP-IG's k = m (the base run)
    if embed is not None:
        source_embeddings, base_embeddings = embed.unflat(source[embed.path]), embed.unflat(base[embed.path])
        for k in range(1, steps):
            embeddings = source_embeddings + (k / steps) * (base_embeddings - source_embeddings)
            step = node_gradients(runner, runner.base_ids, resolved, {embed.path: ReplacePatch(value=embeddings)})[1]
            grads = {path: grads[path] + step[path] for path in step}
        grads = {path: grad / steps for path, grad in grads.items()}
    totals = {node.path: head_totals(node, (source[node.path] - base[node.path]) * grads[node.path])
              for node in resolved}
    m_clean, m_corrupted = (m_base, m_source) if direction == "noise" else (m_source, m_base)
    return AttributionResult("atp-ig" if steps else "atp", direction, m_clean, m_corrupted, forward=runner.forwards,
                             backward=runner.backwards, seconds=time.perf_counter() - start,
                             scores=unit_scores(resolved, chosen, totals))
