"""Edge attribution: EAP, EAP-IG, exact edge patching and the faithfulness of top-k circuits.

EAP (Syed et al. 2023, "Attribution Patching Outperforms Automated Circuit Discovery", eq. 2):
score(u → v) = (z_u^source − z_u^base) · ∂M/∂input_v at the base run, every edge from one forward and one backward.
EAP-IG (Hanna et al. 2024, "Have Faith in Faithfulness", section 3, the "inputs" variant): the gradient is averaged
over m runs whose token embeddings are interpolated, e_source + (k/m)(e_base − e_source) for k = 1..m.
Circuits are the top-k edges by |score|; a circuit's faithfulness is (M_circuit − M_source) / (M_base − M_source),
where M_circuit is the metric with every edge outside the circuit carrying its source value (section 4).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ..errors import NonFiniteError
from ..patchable_graph import PatchableGraph
from .edge_graph import Deltas, EdgeForward, EdgeGraph
from .errors import AttributionError
from .metrics import Metric, logit_difference
from .prompts import PromptBatch
from .records import AttributionResult, EdgeScore
from .runner import Progress, Runner

__all__ = ["DEFAULT_FRACTIONS", "eap", "edge_patching", "faithfulness_curve"]

#: Circuit sizes of the faithfulness curve, as fractions of all edges.
DEFAULT_FRACTIONS = (0.0, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)


def _columns(graph: EdgeGraph, layer: int | None, part: str) -> slice:
    if layer is None:
        return slice(graph.n_down - 1, graph.n_down)
    first = layer * graph.per_layer_down
    return slice(first, first + graph.per_layer_down - 1) if part == "attn" else slice(
        first + graph.per_layer_down - 1, first + graph.per_layer_down)


def _record(runner: Runner, graph: EdgeGraph, ids: torch.Tensor) -> tuple[torch.Tensor, float]:
    """Upstream outputs ``[n_up, batch, seq, d_model]`` of an unpatched run, and its metric."""
    forward = EdgeForward(runner.pg, graph, lambda layer, part, upstream: None)
    with torch.no_grad():
        value = float(runner.value(runner.logits(ids, forward.patches())))
    return torch.stack(forward.upstream), value


def _gradients(runner: Runner, graph: EdgeGraph, ids: torch.Tensor,
               embeddings: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, float]:
    """One forward and backward: upstream outputs ``[n_up, batch, seq, d]``, ∂M/∂input_v ``[n_down, batch, seq, d]``.

    Raises:
        NonFiniteError: a non-finite gradient (naming the downstream input).
    """
    batch, seq = ids.shape
    parts = [(layer, part) for layer in range(graph.layers) for part in ("attn", "mlp")] + [(None, "logits")]
    params = {}
    for layer, part in parts:
        columns = _columns(graph, layer, part)
        params[(layer, part)] = nn.Parameter(torch.zeros(batch, seq, columns.stop - columns.start, graph.d_model,
                                                         device=ids.device))
    forward = EdgeForward(runner.pg, graph, lambda layer, part, upstream: params[(layer, part)], embeddings)
    with torch.enable_grad():
        value = runner.value(runner.logits(ids, forward.patches()))
        grads = torch.autograd.grad(value, list(params.values()), allow_unused=True)
    runner.backwards += 1
    columns = torch.zeros(graph.n_down, batch, seq, graph.d_model, device=ids.device)
    for (key, param), grad in zip(params.items(), grads):
        if grad is not None:
            columns[_columns(graph, *key)] = grad.permute(2, 0, 1, 3)
    if not bool(torch.isfinite(columns).all()):
        bad = graph.downstream_names()[int((~torch.isfinite(columns)).flatten(1).any(1).nonzero()[0])]
        raise NonFiniteError(f"the gradient of the metric at the input of {bad!r} holds NaN or ±inf; check the metric "
                             f"and run in float32")
    return torch.stack([u.detach() for u in forward.upstream]), columns, float(value.detach())


def eap(pg: PatchableGraph, batch: PromptBatch, metric: Metric = logit_difference, *, steps: int = 0,
        direction: str = "noise", fractions: Sequence[float] = DEFAULT_FRACTIONS, batch_size: int = 32,
        forward_kwargs: Mapping[str, Any] | None = None, progress: Progress | None = None) -> AttributionResult:
    """EAP (``steps=0``) or EAP-IG (``steps=m``) scores of every edge, and the faithfulness curve of top-k circuits.

    Args:
        pg: a Llama-style graph.
        batch: prompt pairs.
        metric: ``metric(logits [batch, vocab], batch) -> scalar``.
        steps: 0 for EAP; m ≥ 1 interpolation steps for EAP-IG.
        direction: ``"noise"`` (edges carry corrupted values into the clean run) or ``"denoise"``.
        fractions: circuit sizes of the faithfulness curve (fractions of all edges).
        batch_size: rows per forward pass of the faithfulness runs.
        forward_kwargs: keyword arguments of every call of ``pg``.
        progress: ``progress(done, total)`` over faithfulness points.

    Returns:
        An :class:`AttributionResult` (method ``"eap"`` or ``"eap-ig"``) with ``edges`` (best first) and
        ``faithfulness`` ``[(k, value)]``.

    Raises:
        AttributionError: not a Llama-style graph, ``steps`` < 0, a fraction outside [0, 1], bad metric or direction.
        NonFiniteError: a non-finite gradient.
    """
    start = time.perf_counter()
    graph = EdgeGraph.of(pg)
    if steps < 0:
        raise AttributionError(f"steps={steps}: give 0 (EAP) or the number of EAP-IG interpolation steps (e.g. 5)")
    if any(not 0 <= f <= 1 for f in fractions):
        raise AttributionError(f"fractions {list(fractions)} must lie in [0, 1] (shares of all edges)")
    runner = Runner(pg, batch, metric, direction, forward_kwargs)
    source, m_source = _record(runner, graph, runner.source_ids)
    if steps == 0:
        base, grads, m_base = _gradients(runner, graph, runner.base_ids)
    else:
        base, m_base = _record(runner, graph, runner.base_ids)
        grads = torch.zeros(graph.n_down, *base.shape[1:], device=base.device)
        for k in range(1, steps + 1):
            embeddings = source[0] + (k / steps) * (base[0] - source[0])
            grads += _gradients(runner, graph, runner.base_ids, embeddings)[1] / steps
    scores = ((source - base).flatten(1) @ grads.flatten(1).T).cpu()  # [n_up, n_down]
    allowed = graph.reach()
    scores = scores.masked_fill(~allowed, 0.0)
    up, down = graph.upstream_names(), graph.downstream_names()
    order = [int(i) for i in scores.abs().flatten().argsort(descending=True) if allowed.flatten()[i]]
    edges = [EdgeScore(up[i // graph.n_down], down[i % graph.n_down], float(scores.flatten()[i])) for i in order]
    total = int(allowed.sum())
    ks = sorted({round(f * total) for f in fractions})
    curve = faithfulness_curve(runner, graph, source, order, ks, m_base, m_source, batch_size, progress)
    m_clean, m_corrupted = (m_base, m_source) if direction == "noise" else (m_source, m_base)
    return AttributionResult("eap-ig" if steps else "eap", direction, m_clean, m_corrupted, forward=runner.forwards,
                             backward=runner.backwards, seconds=time.perf_counter() - start, edges=edges,
                             faithfulness=curve)


def _masked_deltas(graph: EdgeGraph, source: torch.Tensor, masks: torch.Tensor, rows: int) -> Deltas:
    """The δ function of :class:`EdgeForward` for variant masks ``[variants, n_up, n_down]`` (True: the edge carries its
    source value) over ``rows`` prompts per variant."""
    def deltas(layer: int | None, part: str, upstream: list[torch.Tensor]) -> torch.Tensor | None:
        count = len(upstream)
        chosen = masks[:, :count, _columns(graph, layer, part)]  # [variants, count, n]
        if not bool(chosen.any()):
            return None
        blocks = []
        for v in range(chosen.shape[0]):
            current = torch.stack([u[v * rows:(v + 1) * rows] for u in upstream])  # [count, rows, seq, d]
            difference = (source[:count] - current).flatten(1)  # [count, rows * seq * d]
            blocks.append((chosen[v].T.to(difference.device, difference.dtype) @ difference).reshape(
                chosen.shape[2], rows, *upstream[0].shape[1:]))  # [n, rows, seq, d]
        return torch.cat(blocks, dim=1).permute(1, 2, 0, 3)  # [variants * rows, seq, n, d]
    return deltas


def _run_masks(runner: Runner, graph: EdgeGraph, source: torch.Tensor, masks: torch.Tensor) -> list[float]:
    """The metric of each variant (one row block per mask ``[n_up, n_down]``) in one forward pass."""
    rows = runner.batch.size
    forward = EdgeForward(runner.pg, graph, _masked_deltas(graph, source, masks, rows))
    with torch.no_grad():
        logits = runner.logits(runner.base_ids.repeat(masks.shape[0], 1), forward.patches())
        return [float(runner.value(logits[v * rows:(v + 1) * rows])) for v in range(masks.shape[0])]


def faithfulness_curve(runner: Runner, graph: EdgeGraph, source: torch.Tensor, order: Sequence[int],
                       ks: Sequence[int], m_base: float, m_source: float, batch_size: int,
                       progress: Progress | None = None) -> list[tuple[int, float]]:
    """``[(k, (M_k − M_source) / (M_base − M_source))]``: M_k with every allowed edge outside the first ``k`` of
    ``order`` (flat ``n_up * n_down`` indices) carrying its source value.

    Raises:
        AttributionError: the base and source metrics are equal (faithfulness is undefined).
    """
    if abs(m_base - m_source) < 1e-9:
        raise AttributionError("the clean and corrupted metrics are equal, so faithfulness is undefined: choose "
                               "prompts whose corrupted run changes the metric")
    allowed = graph.reach()
    per_pass = max(1, batch_size // runner.batch.size)
    ranked = torch.tensor(list(order), dtype=torch.long)
    curve = []
    for first in range(0, len(ks), per_pass):
        chunk = ks[first:first + per_pass]
        masks = allowed.unsqueeze(0).repeat(len(chunk), 1, 1)
        for v, k in enumerate(chunk):
            masks[v].view(-1)[ranked[:k]] = False
        for k, value in zip(chunk, _run_masks(runner, graph, source, masks)):
            curve.append((k, (value - m_source) / (m_base - m_source)))
        if progress is not None:
            progress(first + len(chunk), len(ks))
    return curve


def edge_patching(pg: PatchableGraph, batch: PromptBatch, edges: Sequence[tuple[str, str]],
                  metric: Metric = logit_difference, *, direction: str = "noise", batch_size: int = 32,
                  forward_kwargs: Mapping[str, Any] | None = None) -> list[EdgeScore]:
    """Exact edge patching: for each edge (upstream, downstream), the metric with that one edge carrying its source
    value, minus the base metric; many edges per forward pass (one row block each).

    Raises:
        AttributionError: an unknown or impossible edge (downstream before upstream), not a Llama-style graph.
    """
    graph = EdgeGraph.of(pg)
    up = {name: i for i, name in enumerate(graph.upstream_names())}
    down = {name: i for i, name in enumerate(graph.downstream_names())}
    allowed = graph.reach()
    pairs = []
    for u, v in edges:
        if u not in up or v not in down or not bool(allowed[up[u], down[v]]):
            raise AttributionError(f"no edge {u!r} → {v!r}: upstream names are embed, a<layer>.h<head>, m<layer>; "
                                   f"downstream a<layer>.h<head>.q|k|v, m<layer>, logits, in a later place")
        pairs.append((up[u], down[v]))
    runner = Runner(pg, batch, metric, direction, forward_kwargs)
    source, _ = _record(runner, graph, runner.source_ids)
    _, m_base = _record(runner, graph, runner.base_ids)
    per_pass = max(1, batch_size // batch.size)
    scores = []
    for first in range(0, len(pairs), per_pass):
        chunk = pairs[first:first + per_pass]
        masks = torch.zeros(len(chunk), graph.n_up, graph.n_down, dtype=torch.bool)
        for v, (i, j) in enumerate(chunk):
            masks[v, i, j] = True
        for (i, j), value in zip(chunk, _run_masks(runner, graph, source, masks)):
            scores.append(EdgeScore(graph.upstream_names()[i], graph.downstream_names()[j], value - m_base))
    return scores
