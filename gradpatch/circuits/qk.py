"""QK attributions: one attention score decomposed into (query-side node) × (key-side node) terms (Kamath, Ameisen et
al. 2025, "Tracing Attention Computation Through Feature Interactions", transformer-circuits.pub/2025/attention-qk).

In the local replacement model (:mod:`gradpatch.circuits.replacement`) everything from the sources to a later node is
affine: patterns, norm scales (QK-norms' ``rsqrt`` included) frozen, rotary embeddings a fixed linear map per
position. The query of head h at position i of attention layer L (after its norm, QK-norm and rotary embedding, as
the score product reads it, :mod:`gradpatch.circuits.attention`) is therefore

    q = Σ_s q_s + q_bias,      q_s = J_q · contribution_s     ``[head_dim]``

over the graph's source nodes s (features a·W_dec[f], error nodes, token embeddings; paths through earlier attention
layers under their frozen patterns included; a cross-layer transcoder's feature writes a·W_dec[ℓ → ℓ'][f] into every
MLP output ℓ' ≥ ℓ, all of them in q_s: :func:`~gradpatch.circuits.sources.contract_sources` and
:func:`~gradpatch.circuits.sources.source_deltas`), q_bias being q with every source removed; likewise the key k of
position j (of the key/value head h // (heads / kv_heads) under GQA). The pre-softmax score is bilinear:

    s = scale · q · k + m = Σ_{s, s'} scale · q_s · k_s' + m,

with m the mask's constant (0 where the key is visible; ALiBi or another added bias its value), so the terms
T[s, s'] = scale · q_s · k_s' (bias rows and columns included) sum to s − m exactly, up to float rounding. The rows of
J_q come from ``head_dim`` backward passes, batched one row per query (and key) dimension, through the replacement
model with the queries and keys of the chosen layers read live (the values the sources make), while the recorded
ones still go on downstream where the replacement model freezes them (SDPA attention), so every pattern stays frozen
and scores of several layers share one forward and one backward pass. A last row of the same pass removes every
source of the graph: its q and k are q_bias and k_bias.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from ..model_io import frozen_parameters
from ..patches import CustomPatch, HoldPatch, Patch
from .attention import AttentionFitError, AttentionSite, find_attention_sites
from .graph import AttributionGraph
from .replacement import ReplacementModel
from .sources import contract_sources, source_deltas

__all__ = ["QKAttribution", "QKCheck", "QKTerm", "check_qk_term", "pattern_row", "qk_attribution",
           "qk_attributions", "source_label"]

#: The node index that stands for the bias (q or k with every source removed) in :class:`QKTerm`.
BIAS = -1
#: Query rows of T made at a time by :meth:`QKAttribution.reconstruction` and :meth:`QKAttribution.top_terms`.
TERM_ROWS = 4096


@dataclass(frozen=True)
class QKTerm:
    """One term scale · q_s · k_s' (``query_node``/``key_node``: graph node indices, :data:`BIAS` for the bias)."""

    query_node: int
    key_node: int
    value: float


@dataclass
class QKAttribution:
    """The decomposition of one pre-softmax score (module docstring).

    Attributes:
        layer, head, query_position, key_position: the score's attention layer, query head and positions.
        scale: the score's factor (1/√head_dim unless the model sets another).
        mask: the constant added to the score m (0 for a visible key without ALiBi).
        query, key: the recorded q and k ``[head_dim]`` (the model's, after norms and rotary embeddings).
        query_nodes, key_nodes: the graph nodes with a non-zero part ``[n_q]``, ``[n_k]``.
        query_parts, key_parts: q_s ``[n_q + 1, head_dim]`` and k_s' ``[n_k + 1, head_dim]``, the last row the bias.
    """

    layer: int
    head: int
    query_position: int
    key_position: int
    scale: float
    mask: float
    query: torch.Tensor
    key: torch.Tensor
    query_nodes: torch.Tensor
    key_nodes: torch.Tensor
    query_parts: torch.Tensor
    key_parts: torch.Tensor

    @property
    def score(self) -> float:
        """The model's pre-softmax score s = scale · q · k + m."""
        return self.scale * float(self.query.double() @ self.key.double()) + self.mask

    def terms(self) -> torch.Tensor:
        """T = scale · query_parts · key_partsᵀ ``[n_q + 1, n_k + 1]`` (rows: query side, last = bias), float64:
        8 (n_q + 1)(n_k + 1) bytes (:meth:`reconstruction` and :meth:`top_terms` never hold it whole)."""
        return self.scale * self.query_parts.double() @ self.key_parts.double().T

    def _term_rows(self) -> Iterator[tuple[int, torch.Tensor]]:
        """T in blocks of :data:`TERM_ROWS` query rows: (first row, ``[rows, n_k + 1]``)."""
        keys = self.key_parts.double().T
        for start in range(0, self.query_parts.shape[0], TERM_ROWS):
            yield start, self.scale * self.query_parts[start:start + TERM_ROWS].double() @ keys

    def reconstruction(self) -> tuple[float, float]:
        """(|Σ T + m − s|, Σ |T|): how far the terms miss the score, and their scale (T in blocks of rows)."""
        total = magnitude = 0.0
        for _, block in self._term_rows():
            total += float(block.sum())
            magnitude += float(block.abs().sum())
        return abs(total + self.mask - self.score), magnitude

    def top_terms(self, k: int = 10) -> list[QKTerm]:
        """The ``k`` terms of largest |value|, largest first (T in blocks of rows, a running top k)."""
        width = self.key_parts.shape[0]
        values = torch.zeros(0, dtype=torch.float64)
        where = torch.zeros(0, dtype=torch.long)
        for start, block in self._term_rows():
            values = torch.cat([values, block.flatten()])
            where = torch.cat([where, start * width + torch.arange(block.numel())])
            kept = values.abs().topk(min(k, values.numel())).indices
            values, where = values[kept], where[kept]
        nodes_q = self.query_nodes.tolist() + [BIAS]
        nodes_k = self.key_nodes.tolist() + [BIAS]
        return [QKTerm(nodes_q[i // width], nodes_k[i % width], float(v)) for v, i in zip(values.tolist(),
                                                                                          where.tolist())]


@dataclass(frozen=True)
class QKCheck:
    """A term against perturbations of the frozen model (:func:`check_qk_term`).

    Attributes:
        term, measured_term: T[s, s'] and scale · Δq · Δk / ε² with Δq from moving s by ε on the query side and
            Δk from moving s' by ε on the key side.
        row, measured_row: Σ_s' T[s, s'] = scale · q_s · k and scale · Δq · k / ε (the key at its recorded value).
    """

    term: float
    measured_term: float
    row: float
    measured_row: float


def _site(model: ReplacementModel, layer: int) -> AttentionSite:
    sites = find_attention_sites(model.pg)
    if not 0 <= layer < len(sites):
        raise AttentionFitError(f"attention layer {layer} out of range: the model has {len(sites)} (0 .. "
                                f"{len(sites) - 1})")
    return sites[layer]


@dataclass
class _Held:
    """What a live run read, per site's layer: q ``[rows, heads, seq, d]``, k ``[rows, kv_heads, seq, d]``, the mask;
    and (with gradients) the MLP outputs and the embeddings."""

    queries: dict[int, torch.Tensor]
    keys: dict[int, torch.Tensor]
    masks: dict[int, torch.Tensor | None]
    outputs: dict[int, torch.Tensor]
    embeddings: torch.Tensor | None


def _read_then_freeze(read: dict[str, torch.Tensor], path: str, value: torch.Tensor | None
                      ) -> Callable[[torch.Tensor], torch.Tensor]:
    """A patch op that keeps the live value in ``read[path]`` and passes on the recorded ``value`` (as the
    replacement model's freezing does; the live value when ``value`` is ``None``)."""
    def op(live: torch.Tensor) -> torch.Tensor:
        read[path] = live
        return live if value is None else value.to(live.dtype).expand(live.shape).contiguous()
    return op


def _live_run(model: ReplacementModel, sites: Sequence[AttentionSite], rows: int,
              deltas: dict[int, torch.Tensor] | None = None, embed_delta: torch.Tensor | None = None,
              keep_graph: bool = False) -> _Held:
    """The replacement model on ``rows`` copies, reading the live query and key of ``sites`` (after their norms and
    rotary embeddings, as the source contributions make them) while every pattern stays frozen: where the replacement
    model freezes a query or key (SDPA), the recorded value still goes on downstream."""
    live = copy.copy(model)
    paths = {path for site in sites for path in (site.query, site.key)}
    live.frozen_values = {p: v for p, v in model.frozen_values.items() if p not in paths}
    read: dict[str, torch.Tensor] = {}
    patches: dict[str, list[Patch]] = {
        path: [CustomPatch(custom_op=_read_then_freeze(read, path, model.frozen_values.get(path)),
                           requires_clone=False)] for path in paths if path is not None}
    for site in sites:
        if site.mask is not None:
            patches.setdefault(site.mask, []).append(CustomPatch(custom_op=_read_then_freeze(read, site.mask, None),
                                                                 requires_clone=False))
    outputs = {layer: HoldPatch() for layer in model.layers}
    embed = HoldPatch(leaf=True)
    if keep_graph:
        patches.setdefault(model.embed, []).append(embed)
        for layer, spliced in model.layers.items():
            patches.setdefault(spliced.output_node, []).append(outputs[layer])
    transcoders = [s.transcoder for s in model.layers.values()]
    with torch.set_grad_enabled(keep_graph), frozen_parameters(model.pg, *transcoders):
        live.run(rows, deltas=deltas, embed_delta=embed_delta, patches=patches)
    return _Held({site.layer: read[site.query] for site in sites if site.query is not None},
                 {site.layer: read[site.key] for site in sites if site.key is not None},
                 {site.layer: read[site.mask].detach() if site.mask is not None else None for site in sites},
                 {layer: holder.held for layer, holder in outputs.items()} if keep_graph else {},
                 embed.held if keep_graph else None)


def _mask_value(site: AttentionSite, mask: torch.Tensor | None, head: int, query: int, key: int) -> float:
    """m at (head, query, key): the added mask's value (a boolean mask: 0 where True, −∞ elsewhere); −∞ after the
    query under a causal op."""
    if site.causal and key > query:
        return -math.inf
    if mask is None:
        return 0.0
    value = mask[0, head if mask.shape[1] > 1 else 0, query, key]
    if value.dtype == torch.bool:
        return 0.0 if bool(value) else -math.inf
    return float(value)


def _kv_head(query: torch.Tensor, key: torch.Tensor, head: int) -> int:
    return head // (query.shape[1] // key.shape[1])


def pattern_row(model: ReplacementModel, layer: int, query_position: int) -> torch.Tensor:
    """The recorded attention pattern of every head of ``layer`` at ``query_position``: softmax over the keys of
    scale · q · k + m ``[heads, seq]`` (float32).

    Raises:
        AttentionFitError: ``layer`` out of range, or its score not bilinear (:func:`find_attention_sites`).
    """
    site = _site(model, layer)
    held = _live_run(model, [site], 1)
    query = held.queries[layer][0, :, query_position].float()  # [heads, d]
    key = held.keys[layer][0].float()  # [kv_heads, seq, d]
    heads, seq = query.shape[0], key.shape[1]
    key = key.repeat_interleave(heads // key.shape[0], dim=0)
    scores = site.scale * torch.einsum("hd,hsd->hs", query, key)
    masks = torch.tensor([[_mask_value(site, held.masks[layer], h, query_position, j) for j in range(seq)]
                          for h in range(heads)], device=scores.device)
    return torch.softmax(scores + masks, dim=-1)


def qk_attributions(model: ReplacementModel, graph: AttributionGraph,
                    requests: Sequence[tuple[int, int, int, int]], batch_size: int = 256) -> list[QKAttribution]:
    """The QK attributions of several scores (module docstring).

    Args:
        model: the replacement model the graph was built on.
        graph: its attribution graph (its source nodes are the terms' nodes).
        requests: (attention layer, query head, query position, key position) per score.
        batch_size: rows per forward pass (each score takes 2 · head_dim rows; at least one score per pass).

    Returns:
        One :class:`QKAttribution` per request, in order.

    Raises:
        AttentionFitError: a layer out of range or whose score is not bilinear; a head or position out of range;
            a key the mask hides from the query (its score is −∞).
    """
    sites = find_attention_sites(model.pg)
    for layer, head, query_position, key_position in requests:
        if not 0 <= layer < len(sites):
            raise AttentionFitError(f"attention layer {layer} out of range: the model has {len(sites)} (0 .. "
                                    f"{len(sites) - 1})")
        heads = model.pg.node(sites[layer].query).tensor_shape[1]  # the example's sequence may be shorter
        seq = model.ids.shape[1]
        if not (0 <= head < heads and 0 <= key_position <= query_position < seq):
            raise AttentionFitError(f"layer {layer}: head {head}, query {query_position}, key {key_position} "
                                    f"out of range: give 0 <= head < {heads} and 0 <= key <= query < {seq}")
    removal = source_deltas(model, graph, [{j: -1.0 for j in range(graph.logit_start)}])
    found: list[QKAttribution] = []
    chunk: list[tuple[int, int, int, int]] = []
    rows = 0
    for request in requests:
        width = 2 * model.pg.node(sites[request[0]].query).tensor_shape[-1]
        if chunk and rows + width > batch_size:
            found.extend(_parts(model, graph, sites, chunk, removal))
            chunk, rows = [], 0
        chunk.append(tuple(request))  # type: ignore[arg-type]
        rows += width
    if chunk:
        found.extend(_parts(model, graph, sites, chunk, removal))
    return found


def _parts(model: ReplacementModel, graph: AttributionGraph, sites: list[AttentionSite],
           requests: Sequence[tuple[int, int, int, int]],
           removal: tuple[dict[int, torch.Tensor], torch.Tensor]) -> list[QKAttribution]:
    """The attributions of ``requests`` from one forward pass of 2 · head_dim rows per request (its layer's query,
    then key dimensions), row r injecting the unit vector of its dimension in one backward pass, plus a last row
    with every source removed (``removal``, :func:`source_deltas`' one row): its q and k are the biases."""
    widths = [model.pg.node(sites[layer].query).tensor_shape[-1] for layer, *_ in requests]
    starts = [2 * sum(widths[:i]) for i in range(len(requests))]
    rows = 2 * sum(widths)
    deltas = {layer: torch.cat([torch.zeros_like(d).expand(rows, *d.shape[1:]), d]) for layer, d in removal[0].items()}
    embed = torch.cat([torch.zeros_like(removal[1]).expand(rows, *removal[1].shape[1:]), removal[1]])
    chosen = sorted({layer for layer, *_ in requests})
    held = _live_run(model, [sites[layer] for layer in chosen], rows + 1, deltas, embed, keep_graph=True)
    inject_q = {layer: torch.zeros_like(held.queries[layer]) for layer in chosen}
    inject_k = {layer: torch.zeros_like(held.keys[layer]) for layer in chosen}
    for (layer, head, query_position, key_position), width, first in zip(requests, widths, starts):
        if _mask_value(sites[layer], held.masks[layer], head, query_position, key_position) == -math.inf:
            raise AttentionFitError(f"layer {layer} head {head}: the mask hides key {key_position} from query "
                                    f"{query_position} (a sliding window?); its score is -inf, choose a visible key")
        dims = torch.arange(width, device=inject_q[layer].device)
        inject_q[layer][first + dims, head, query_position, dims] = 1.0
        kv = _kv_head(held.queries[layer], held.keys[layer], head)
        inject_k[layer][first + width + dims, kv, key_position, dims] = 1.0
    layers = sorted(held.outputs)
    grads = torch.autograd.grad([held.queries[l] for l in chosen] + [held.keys[l] for l in chosen],
                                [held.outputs[l] for l in layers] + [held.embeddings],
                                [inject_q[l] for l in chosen] + [inject_k[l] for l in chosen], allow_unused=True)
    gradients = {layer: g[:rows] for layer, g in zip(layers, grads[:-1]) if g is not None}
    embed_gradient = grads[-1][:rows] if grads[-1] is not None else torch.zeros_like(held.embeddings[:rows])
    contracted = contract_sources(model, graph, gradients, embed_gradient)  # [rows, sources]
    found = []
    for (layer, head, query_position, key_position), width, first in zip(requests, widths, starts):
        query, key = held.queries[layer].detach(), held.keys[layer].detach()
        kv = _kv_head(query, key, head)
        found.append(_attribution(sites[layer], head, query_position, key_position,
                                  _mask_value(sites[layer], held.masks[layer], head, query_position, key_position),
                                  query[0, head, query_position], key[0, kv, key_position],
                                  contracted[first:first + width].T, contracted[first + width:first + 2 * width].T,
                                  query[rows, head, query_position], key[rows, kv, key_position]))
    return found


def _attribution(site: AttentionSite, head: int, query_position: int, key_position: int, mask: float,
                 query: torch.Tensor, key: torch.Tensor, q_parts: torch.Tensor, k_parts: torch.Tensor,
                 q_bias: torch.Tensor, k_bias: torch.Tensor) -> QKAttribution:
    """A :class:`QKAttribution` keeping the nodes whose part is not zero."""
    q_nodes = q_parts.abs().sum(-1).nonzero().squeeze(-1)
    k_nodes = k_parts.abs().sum(-1).nonzero().squeeze(-1)
    return QKAttribution(site.layer, head, query_position, key_position, site.scale, mask, query.float().cpu(),
                         key.float().cpu(), q_nodes.cpu(), k_nodes.cpu(),
                         torch.cat([q_parts[q_nodes], q_bias.float()[None]]).cpu(),
                         torch.cat([k_parts[k_nodes], k_bias.float()[None]]).cpu())


def qk_attribution(model: ReplacementModel, graph: AttributionGraph, layer: int, head: int, query_position: int,
                   key_position: int) -> QKAttribution:
    """The QK attribution of one score (:func:`qk_attributions` of one request)."""
    return qk_attributions(model, graph, [(layer, head, query_position, key_position)])[0]


def check_qk_term(model: ReplacementModel, graph: AttributionGraph, attribution: QKAttribution, query_node: int,
                  key_node: int, epsilon: float = 1.0) -> QKCheck:
    """A term of ``attribution`` against perturbations of the frozen model: one run moves ``query_node``'s
    contribution by ε (read on the query side), one moves ``key_node``'s (read on the key side). The model is affine
    in the sources, so any ε gives the same ratio up to rounding.

    Raises:
        CircuitError: a node that is not among the attribution's nodes (the bias cannot be moved).
    """
    q_index = (attribution.query_nodes == query_node).nonzero()
    k_index = (attribution.key_nodes == key_node).nonzero()
    if not len(q_index) or not len(k_index):
        raise AttentionFitError(f"nodes {query_node} (query side) and {key_node} (key side) must both have a part "
                                f"in this attribution; choose among its query_nodes and key_nodes")
    site = _site(model, attribution.layer)
    deltas, embed = source_deltas(model, graph, [{}, {query_node: epsilon}, {key_node: epsilon}])
    held = _live_run(model, [site], 3, deltas, embed)
    queries, keys = held.queries[site.layer], held.keys[site.layer]
    kv = _kv_head(queries, keys, attribution.head)
    q = queries[:, attribution.head, attribution.query_position].double()
    k = keys[:, kv, attribution.key_position].double()
    i, j = int(q_index[0]), int(k_index[0])
    term = attribution.scale * float(attribution.query_parts[i].double() @ attribution.key_parts[j].double())
    row = attribution.scale * float(attribution.query_parts[i].double() @ attribution.key.double())
    measured = attribution.scale * float((q[1] - q[0]) @ (k[2] - k[0])) / epsilon ** 2
    measured_row = attribution.scale * float((q[1] - q[0]) @ k[0]) / epsilon
    return QKCheck(term, measured, row, measured_row)


def source_label(graph: AttributionGraph, node: int, decode: Callable[[int], str] = str) -> str:
    """A source node's name: ``L{layer} F{feature} @{pos} "tok"``, ``error L{layer} @{pos} "tok"``,
    ``embedding @{pos} "tok"``, or ``bias`` for :data:`BIAS` (``decode``: token id -> text)."""
    if node == BIAS:
        return "bias"
    if node < graph.error_start:
        layer, position, feature = (int(v) for v in graph.active_features[node])
        name = f"L{layer} F{feature}"
    elif node < graph.token_start:
        index, position = divmod(node - graph.error_start, graph.n_pos)
        name = f"error L{graph.layers[index]}"
    else:
        position, name = node - graph.token_start, "embedding"
    token = decode(int(graph.input_tokens[position]))
    return f"{name} @{position} {token!r}"
