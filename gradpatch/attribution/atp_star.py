"""AtP* (Kramár et al. 2024, arXiv 2403.00745, section 3): AtP with the QK fix and GradDrop.

QK fix (section 3.1.1, eqs. 7–10): patching a query or a key changes attention scores, and the softmax that turns them
into the pattern A saturates, so its linearisation misses large effects. For a query node (head h, position t) the
patched row A'_t = softmax(q'_t Kᵀ / √d + causal mask) is computed exactly; for a key node (kv head g, position s)
every row t ≥ s of every query head of g is recomputed with the one score z_ts replaced. Only the rest of the model
is linearised: estimate = Σ (A' − A) · ∂M/∂A, with ∂M/∂A = ∂M/∂O · Vᵀ (O = A V, the attention's output before the
heads are merged, whose gradient is a zero AddPatch's).

GradDrop (section 3.1.2, eq. 11): cancellation between a node's direct and indirect effects makes AtP estimate ~0 for
important nodes. For each block l the backward pass is rerun with the gradient stopped where the block's attention
and MLP outputs join the residual stream, giving AtP_l; the score is mean over prompts of Σ_l |AtP_l| / (L − 1), a
magnitude (the paper ranks nodes by |effect|), at the cost of L more forward and backward passes.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..patchable_graph import PatchableGraph
from ..patches import CustomPatch
from .atp import head_totals, node_gradients, unit_scores
from .errors import AttributionError
from .metrics import Metric, logit_difference
from .nodes import QK_KINDS, ModelFamily, Node, as_nodes, attention_nodes, count_layers, detect_family
from .prompts import PromptBatch
from .records import AttributionResult
from .runner import Runner, check_positions

__all__ = ["atp_star", "attention_pattern", "qk_fixed_totals"]


def attention_pattern(queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Causal attention probabilities ``softmax(q kᵀ / √d)``: ``[batch, heads, seq, seq]`` from queries
    ``[batch, heads, seq, d]`` and keys ``[batch, kv_heads, seq, d]`` (grouped-query attention: each kv head serves
    ``heads / kv_heads`` consecutive query heads)."""
    return torch.softmax(_scores(queries, keys), dim=-1)


def _expand(keys: torch.Tensor, heads: int) -> torch.Tensor:
    return keys.repeat_interleave(heads // keys.shape[1], dim=1)


def _scores(queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    scores = queries.float() @ _expand(keys, queries.shape[1]).float().transpose(-1, -2) * queries.shape[-1] ** -0.5
    seq = queries.shape[2]
    future = torch.ones(seq, seq, dtype=torch.bool, device=queries.device).triu(1)
    return scores.masked_fill(future, float("-inf"))


def qk_fixed_totals(queries: torch.Tensor, keys: torch.Tensor, source_queries: torch.Tensor,
                    source_keys: torch.Tensor, pattern_grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """AtP* estimates for every query and key unit of one attention layer (eqs. 7–10).

    Args:
        queries, keys: the base run's ``[batch, heads, seq, d]`` and ``[batch, kv_heads, seq, d]``.
        source_queries, source_keys: the source run's, same shapes.
        pattern_grad: ∂M/∂A ``[batch, heads, seq, seq]`` at the base run.

    Returns:
        ``(query_totals [batch, seq, heads], key_totals [batch, seq, kv_heads])``, per prompt row.
    """
    heads, kv_heads = queries.shape[1], keys.shape[1]
    base_scores = _scores(queries, keys)
    pattern = torch.softmax(base_scores, dim=-1)
    query_rows = torch.softmax(_scores(source_queries, keys), dim=-1)  # row t uses q'_t
    query_totals = ((query_rows - pattern) * pattern_grad).sum(-1).transpose(1, 2)  # [batch, seq, heads]
    key_scores = _scores(queries, source_keys)  # column s uses k'_s
    seq = queries.shape[2]
    one_key = torch.eye(seq, dtype=torch.bool, device=queries.device)[:, None, :]  # [s, 1, u]
    patched = torch.where(one_key, key_scores[:, :, None], base_scores[:, :, None])  # [batch, heads, s, t, u]
    change = (torch.softmax(patched, dim=-1) - pattern[:, :, None]).nan_to_num()
    per_head = (change * pattern_grad[:, :, None]).sum((-1, -2))  # [batch, heads, s]
    key_totals = per_head.reshape(per_head.shape[0], kv_heads, heads // kv_heads, seq).sum(2).transpose(1, 2)
    return query_totals, key_totals


def _check_pattern(node: Node, pattern: torch.Tensor, values: torch.Tensor, output: torch.Tensor) -> None:
    recomputed = pattern @ _expand(values, pattern.shape[1]).float()
    if not torch.allclose(recomputed, output.float(), atol=1e-4, rtol=1e-3):
        raise AttributionError(f"block {node.layer}'s attention is not softmax(q kᵀ / √d + causal mask) v (largest "
                               f"difference {float((recomputed - output).abs().max()):.3g}): the QK fix does not apply "
                               f"to this model; use atp for its query and key nodes")


def _drop_patches(family: ModelFamily, layer: int) -> dict[str, CustomPatch]:
    def stop(value: torch.Tensor) -> torch.Tensor:
        return value.detach()

    return {family.path(part, layer): CustomPatch(custom_op=stop, requires_clone=False) for part in ("attn", "mlp")}


def atp_star(pg: PatchableGraph, batch: PromptBatch, nodes: str | Sequence[str] | Sequence[Node] = "all",
             metric: Metric = logit_difference, *, positions: Sequence[int] | None = None, direction: str = "noise",
             grad_drop: bool = False, forward_kwargs: Mapping[str, Any] | None = None) -> AttributionResult:
    """AtP* scores of every unit: the QK fix for ``"queries"`` / ``"keys"`` nodes, AtP for the others, and with
    ``grad_drop`` the GradDrop magnitudes of all of them.

    Args:
        grad_drop: average |AtP| over the L backward passes that each stop one block's gradient (eq. 11); scores are
            then magnitudes ≥ 0. Costs L more forward and backward passes.
        (the others): as for :func:`~gradpatch.attribution.atp.atp`.

    Returns:
        An :class:`AttributionResult` (method ``"atp-star"``).

    Raises:
        AttributionError: bad input (before any forward pass); an attention the QK fix cannot recompute.
        NonFiniteError: a non-finite gradient, naming the node.
    """
    start = time.perf_counter()
    resolved = as_nodes(pg, nodes)
    chosen = check_positions(positions, batch.length)
    qk_layers = sorted({n.layer for n in resolved if n.kind in QK_KINDS and n.layer is not None})
    family = detect_family(pg) if qk_layers or grad_drop else None
    attention = {layer: attention_nodes(pg, family, layer) for layer in qk_layers} if family else {}
    hidden = [n for parts in attention.values() for n in parts.values()]
    everything = list({n.path: n for n in (*resolved, *hidden)}.values())
    runner = Runner(pg, batch, metric, direction, forward_kwargs)
    source, m_source = runner.record(runner.source_ids, everything)
    runs = [None, *range(count_layers(pg, family))] if grad_drop and family else [None]
    estimates: list[dict[str, torch.Tensor]] = []
    m_base = 0.0
    for dropped in runs:
        extra = _drop_patches(family, dropped) if family and dropped is not None else None
        base, grads, value = node_gradients(runner, runner.base_ids, everything, extra, after=True)
        if dropped is None:
            m_base = value
        totals = {n.path: head_totals(n, (source[n.path] - base[n.path]) * grads[n.path]) for n in resolved}
        for layer, parts in attention.items():
            q, k, v, o = (parts[name] for name in ("queries", "keys", "values", "pattern_output"))
            queries, keys, values = (node.unflat(base[node.path]) for node in (q, k, v))
            if dropped is None:
                _check_pattern(q, attention_pattern(queries, keys), values, o.unflat(base[o.path]))
            pattern_grad = o.unflat(grads[o.path]).float() @ _expand(values, q.n_heads or 1).float().transpose(-1, -2)
            query_totals, key_totals = qk_fixed_totals(queries, keys, q.unflat(source[q.path]),
                                                       k.unflat(source[k.path]), pattern_grad)
            for node in resolved:
                if node.layer == layer and node.kind == "queries":
                    totals[node.path] = query_totals
                elif node.layer == layer and node.kind == "keys":
                    totals[node.path] = key_totals
        estimates.append(totals)
    if grad_drop and len(runs) > 2:
        layers = len(runs) - 1
        final = {path: sum(run[path].abs() for run in estimates[1:]) / (layers - 1) for path in estimates[0]}
    else:
        final = estimates[0]
    m_clean, m_corrupted = (m_base, m_source) if direction == "noise" else (m_source, m_base)
    return AttributionResult("atp-star", direction, m_clean, m_corrupted, forward=runner.forwards,
                             backward=runner.backwards, seconds=time.perf_counter() - start,
                             scores=unit_scores(resolved, chosen, final))
