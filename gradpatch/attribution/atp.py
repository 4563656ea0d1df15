"""Attribution patching (AtP): the first-order estimate of every unit's patching effect from one backward pass.

score(n) = (a_n^source − a_n^base) · ∂M/∂a_n |_base (Nanda 2023, "Attribution patching: activation patching at
industrial scale"; Kramár et al. 2024, arXiv 2403.00745, eq. 3). The gradient ∂M/∂a_n of every node at once is the
gradient of a zero ``AddPatch`` parameter ``[batch, seq, width]`` added at the node; for heads the dot product is
taken over the head's slice of the width. Costs two forward passes (source, base) and one backward pass.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ..errors import NonFiniteError
from ..patchable_graph import PatchableGraph
from ..patches import AddPatch, ProbePatch
from .metrics import Metric, logit_difference
from .nodes import Node, as_nodes, units
from .prompts import PromptBatch
from .records import AttributionResult, NodeScore
from .runner import Runner, check_positions

__all__ = ["atp", "node_gradients", "unit_scores"]


def node_gradients(runner: Runner, ids: torch.Tensor, nodes: Sequence[Node],
                   extra: Mapping[str, Any] | None = None) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor],
                                                                    float]:
    """One forward and one backward pass of ``ids``: every node's value and ∂M/∂value, both ``[batch, seq, width]``,
    and the metric.

    Args:
        extra: more patches for the pass (applied before the gradient probes at the same node).

    Raises:
        NonFiniteError: a gradient holds NaN or ±inf (naming the node).
    """
    probes = {node.path: ProbePatch() for node in nodes}
    zeros = {node.path: nn.Parameter(torch.zeros(ids.shape[0], ids.shape[1], node.width, device=ids.device))
             for node in nodes}
    patch_map: dict[str, Any] = {path: [probes[path], AddPatch(value=zero)] for path, zero in zeros.items()}
    for path, patch in (extra or {}).items():
        patch_map[path] = [patch, *patch_map.get(path, [])]
    with torch.enable_grad():
        value = runner.value(runner.logits(ids, patch_map))
        grads = torch.autograd.grad(value, list(zeros.values()), allow_unused=True)
    runner.backwards += 1
    gradients = {}
    for (path, zero), grad in zip(zeros.items(), grads):
        grad = torch.zeros_like(zero) if grad is None else grad
        if not bool(torch.isfinite(grad).all()):
            raise NonFiniteError(f"the gradient of the metric at node '{path}' holds NaN or ±inf; check the metric (a "
                                 f"log of a zero probability?) and the model's dtype (run in float32)")
        gradients[path] = grad
    return {path: probe.activation for path, probe in probes.items()}, gradients, float(value.detach())


def unit_scores(nodes: Sequence[Node], positions: Sequence[int],
                products: Mapping[str, torch.Tensor]) -> list[NodeScore]:
    """Records from per-node products ``[batch, seq, width]`` (summed over the batch, the unit's features).

    Args:
        products: NodePath -> ``(a_source − a_base) * ∂M/∂a``, elementwise.
    """
    sums = {path: product.sum(0) for path, product in products.items()}  # [seq, width]
    scores = []
    for unit in units(nodes, positions):
        value = float(sums[unit.node.path][unit.position, unit.features()].sum())
        scores.append(NodeScore(unit.node.path, unit.position, unit.head, value, unit.node.kind, unit.node.layer))
    return scores


def atp(pg: PatchableGraph, batch: PromptBatch, nodes: str | Sequence[str] | Sequence[Node] = "all",
        metric: Metric = logit_difference, *, positions: Sequence[int] | None = None, direction: str = "noise",
        forward_kwargs: Mapping[str, Any] | None = None) -> AttributionResult:
    """AtP scores of every unit (node, position[, head]) from two forwards and one backward.

    Args:
        pg, batch, nodes, metric, positions, direction, forward_kwargs: as for
            :func:`~gradpatch.attribution.exact.exact_sweep`.

    Returns:
        An :class:`AttributionResult` (method ``"atp"``), scores in the metric's units.

    Raises:
        AttributionError: bad nodes, positions, direction or metric (before any forward pass).
        NonFiniteError: a non-finite gradient, naming the node.
    """
    start = time.perf_counter()
    resolved = as_nodes(pg, nodes)
    chosen = check_positions(positions, batch.length)
    runner = Runner(pg, batch, metric, direction, forward_kwargs)
    source, m_source = runner.record(runner.source_ids, resolved)
    base, grads, m_base = node_gradients(runner, runner.base_ids, resolved)
    products = {path: (source[path] - base[path]) * grads[path] for path in grads}
    m_clean, m_corrupted = (m_base, m_source) if direction == "noise" else (m_source, m_base)
    return AttributionResult("atp", direction, m_clean, m_corrupted, forward=runner.forwards,
                             backward=runner.backwards, seconds=time.perf_counter() - start,
                             scores=unit_scores(resolved, chosen, products))
