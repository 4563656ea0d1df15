"""The attribution graph of one prompt: nodes and the direct-effect adjacency matrix (Ameisen et al. 2025, "Circuit
Tracing", sections 2.3–2.4; circuit-tracer's ``attribute``).

Nodes, in circuit-tracer's order: the active features (layer ℓ, position p, feature f) with a_ℓpf ≠ 0, sorted;
the error nodes (ℓ, p), layer-major; the token embeddings (p); the top output logits at the last position, by
probability until their cumulative probability reaches ``desired_logit_prob`` (at most ``max_n_logits``).

Position 0 (``zero_first_position``, the default): as circuit-tracer does (0.5.0's ``zero_positions = slice(0, 1)``
in ``setup_attribution``; commit d797c82's ``zero_bos``), the activations and error vectors at position 0 are taken
as 0 for the graph: no feature node at position 0, and the error nodes (ℓ, 0) are kept in the layout with a zero
contribution (no edges in or out). The forward pass is unchanged (the residual stream still carries position 0's
MLP outputs, as in circuit-tracer, which only zeroes its recorded copies): their contribution is a constant of the
frozen model, so it joins the targets' biases and every target is still the sum of its incoming edges plus its bias;
the other nodes' edges do not change. circuit-tracer 0.5.0 also prepends a special token to a prompt that does not
start with one (``ensure_tokenized``); :func:`attribute` takes the prompt as given (``gradpatch circuit`` prepends).

Edges are direct effects in the local replacement model (:mod:`gradpatch.circuits.replacement`), which is affine,
so every target is the sum of its sources' contributions plus a constant (biases):

- a feature target's value is its pre-activation h_ℓpf = x_ℓp · W_enc[:, f] + b_enc[f];
- a logit target's value is logit_t − mean_v logit_v at the last position (circuit-tracer's demeaned unembedding);
- a source's contribution is a vector added to the residual stream: a_ℓ'p'f' W_dec[f'] for a feature, e_ℓ'p' for an
  error, the embedding E_p' for a token. With g = ∂target/∂(MLP output of ℓ' at p') (or ∂target/∂E_p'), the edge is

      A[target, source] = g · contribution.

The gradients g come from one forward pass of the replacement model over ``batch`` copies of the prompt, kept for
one backward pass per ``batch`` targets (:mod:`gradpatch.circuits.backward`, circuit-tracer's method); the batch
fits ``max_memory_bytes`` where given (:func:`memory_per_row`). The logit rows come first; then the features are
visited in circuit-tracer's rounds (:func:`~gradpatch.circuits.select.feature_rounds`), at most ``max_feature_nodes``
of them, and only the visited features' rows are computed; the graph keeps those features as its feature nodes. Only
the targets' rows are held (:class:`~gradpatch.circuits.graph.AttributionGraph`: ``rows`` ``[n_targets, n]``, columns
= sources, float32 on the CPU, each batch's rows moved there as they are made). A graph whose rows do not sum to
their targets (edges + bias) is refused (:func:`~gradpatch.circuits.complete.check_completeness`), never returned.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .backward import RetainedForward, Target, measure_saved_bytes
from .complete import check_completeness, decoder_blocks
from .errors import CircuitError, MemoryBoundError
from .graph import AttributionGraph
from .replacement import ReplacementModel
from .select import feature_rounds

__all__ = ["DEFAULT_MAX_FEATURE_NODES", "FEATURE_CHUNK", "AttributionGraph", "attribute", "memory_per_row",
           "plan_batch_size", "salient_logits"]

#: Feature sources whose gradients are gathered at once when the edges are contracted.
FEATURE_CHUNK = 1024
#: The feature nodes :func:`attribute` keeps by default: circuit-tracer 0.5.0's command's ``--max_feature_nodes``.
DEFAULT_MAX_FEATURE_NODES = 7500


def salient_logits(logits: torch.Tensor, max_n_logits: int = 10,
                   desired_logit_prob: float = 0.95) -> tuple[torch.Tensor, torch.Tensor]:
    """The smallest set of top tokens whose cumulative probability reaches ``desired_logit_prob``, at most
    ``max_n_logits`` (circuit-tracer's ``compute_salient_logits``): ids ``[k]`` and probabilities ``[k]`` of the
    last position's ``logits`` ``[vocab]``."""
    probabilities = torch.softmax(logits.float(), dim=-1)
    top_p, top_ids = torch.topk(probabilities, min(max_n_logits, probabilities.shape[-1]))
    cutoff = int(torch.searchsorted(torch.cumsum(top_p, 0), desired_logit_prob)) + 1
    return top_ids[:cutoff], top_p[:cutoff]


@dataclass(frozen=True)
class _Sources:
    """One spliced layer's feature sources: columns ``[k]``, positions ``[k]``, feature ids ``[k]`` and
    activations ``[k]`` (on the model's device)."""

    columns: torch.Tensor
    positions: torch.Tensor
    ids: torch.Tensor
    activations: torch.Tensor


@dataclass(frozen=True)
class _Columns:
    """Where each kind of source sits among the n columns: the error nodes from ``error_start`` (``n_pos`` per
    layer of ``layers``), the tokens from ``token_start``; ``first`` = 1 when position 0's errors get no edges."""

    layers: list[int]
    n_pos: int
    error_start: int
    token_start: int
    n_nodes: int
    first: int


def _sources(model: ReplacementModel, active: torch.Tensor, activations: torch.Tensor) -> dict[int, _Sources]:
    """Each spliced layer's :class:`_Sources`, from the feature nodes (layer, position, feature) ``[k, 3]`` and their
    activations ``[k]`` (column i = feature i)."""
    device = model.embeddings.device
    features, activations = active.to(device), activations.to(device)
    found = {}
    for layer in sorted(model.layers):
        columns = (features[:, 0] == layer).nonzero().squeeze(-1)
        found[layer] = _Sources(columns, features[columns, 1], features[columns, 2], activations[columns])
    return found


def _edges(model: ReplacementModel, columns: _Columns, sources: dict[int, _Sources],
           gradients: dict[int, torch.Tensor], embed_gradient: torch.Tensor) -> torch.Tensor:
    """The rows ``[batch, n]`` of the adjacency from each row's gradients at the MLP outputs ``[batch, seq, d_out]``
    (layers absent: zero) and the embeddings ``[batch, seq, d_model]``: A[t, s] = g · contribution, for all sources
    of a layer at once (feature sources in chunks of :data:`FEATURE_CHUNK`, summed over the MLP outputs their
    decoder blocks write), as a product and a sum over d, whose rows do not depend on the batch (a batched matmul's
    rounding does). With ``columns.first`` the error nodes at position 0 get no edges. The one place a row is
    computed."""
    first, n_pos = columns.first, columns.n_pos
    batch = embed_gradient.shape[0]
    rows = torch.zeros(batch, columns.n_nodes, dtype=torch.float32, device=embed_gradient.device)
    for layer, found in sources.items():
        blocks = [(written, decoder) for written, decoder in decoder_blocks(model, layer) if written in gradients]
        for start in range(0, len(found.columns) if blocks else 0, FEATURE_CHUNK):
            part = slice(start, start + FEATURE_CHUNK)
            edges = sum((gradients[written][:, found.positions[part]].float()
                         * decoder[found.ids[part]].float()).sum(-1) for written, decoder in blocks)
            rows[:, found.columns[part]] = edges * found.activations[part]
    for index, layer in enumerate(columns.layers):
        if layer in gradients:
            grad, errors = gradients[layer][:, first:].float(), model.layers[layer].errors[:, first:].float()
            start = columns.error_start + index * n_pos
            rows[:, start + first:start + n_pos] = (grad * errors).sum(-1)
    rows[:, columns.token_start:columns.token_start + n_pos] = (embed_gradient.float()
                                                                * model.embeddings.float()).sum(-1)
    return rows


def _fill_rows(model: ReplacementModel, forward: RetainedForward, batch: int, columns: _Columns,
               sources: dict[int, _Sources], targets: list[Target], into: torch.Tensor) -> None:
    """Compute the rows of ``targets`` into ``into`` ``[len(targets), n]`` (on the CPU), ``batch`` targets per
    backward pass of ``forward`` (:func:`_edges`)."""
    for start in range(0, len(targets), batch):
        chunk = targets[start:start + batch]
        gradients, embed_gradient = forward.gradients(chunk)
        made = _edges(model, columns, sources, {layer: g[:len(chunk)] for layer, g in gradients.items()},
                      embed_gradient[:len(chunk)])
        into[start:start + len(chunk)] = made.cpu()


def plan_batch_size(model: ReplacementModel, n_nodes: int, n_rows: int, batch_size: int,
                    max_memory_bytes: int | None) -> int:
    """Targets per backward pass: ``batch_size``, at most ``n_rows``, and, with ``max_memory_bytes``, at most
    what fits in it (:func:`memory_per_row`).

    Args:
        n_nodes: n, the columns of a row.
        n_rows: the rows :func:`attribute` computes and holds (the visited features and the logits).

    Raises:
        MemoryBoundError: ``max_memory_bytes`` does not hold one row (the message gives the bytes needed).
    """
    batch = max(1, min(batch_size, n_rows))
    if max_memory_bytes is None:
        return batch
    fixed, per_row = memory_per_row(model, n_nodes, n_rows)
    fits = (max_memory_bytes - fixed) // per_row
    if fits < 1:
        raise MemoryBoundError(f"max_memory_bytes={max_memory_bytes} holds no row: {n_rows} rows of {n_nodes} nodes "
                               f"need {fixed + per_row} bytes for one target per backward pass ({fixed} whatever the "
                               f"batch, {per_row} per target); raise the bound, lower max_feature_nodes or shorten "
                               f"the prompt")
    return int(min(batch, fits))


def memory_per_row(model: ReplacementModel, n_nodes: int, n_rows: int) -> tuple[int, int]:
    """An estimate of the bytes :func:`attribute` holds on the model's device beyond the model's and transcoders'
    parameters and the replacement model's recorded values, (fixed, per row of the batch).

    Per row: what the forward pass keeps for backward passes and its peak above that (measured,
    :func:`~gradpatch.circuits.backward.measure_saved_bytes`); the kept MLP outputs and embeddings, the gradients
    read from them and the gradients injected (each ``[seq, Σ widths]``); the batch's adjacency row ``[n]``
    (float32); a chunk of gathered gradients and their products ``2 × [FEATURE_CHUNK, d_out]``; and a backward
    pass's working gradients, taken as 8 ``[seq, d_model]``. Fixed: what the forward pass keeps whatever the batch,
    plus, when the model is on the CPU (elsewhere the rows are moved to the CPU as they are made), twice the rows
    held ``[n_rows, n]`` (float32): the rows, and either their normalised copy while the features are chosen
    (:func:`~gradpatch.circuits.select.feature_rounds`) or the graph's rows gathered from them at the end.

    Args:
        n_nodes: n, the columns of a row.
        n_rows: the rows computed and held (the visited features and the logits).
    """
    saved = measure_saved_bytes(model)
    seq = model.ids.shape[1]
    itemsize = model.embeddings.element_size()
    d_model = model.embeddings.shape[-1]
    widths = sum(s.transcoder.d_out + s.transcoder.d_in for s in model.layers.values()) + d_model
    d_out = max(s.transcoder.d_out for s in model.layers.values())
    per_row = (saved.per_row + saved.transient_per_row + 2 * seq * widths * itemsize + 4 * n_nodes
               + 2 * FEATURE_CHUNK * d_out * 4 + 8 * seq * d_model * itemsize)
    fixed = saved.fixed + (2 * 4 * n_rows * n_nodes if model.embeddings.device.type == "cpu" else 0)
    return fixed, per_row


def _active_features(model: ReplacementModel, first: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The active features (layer, position, feature) ``[k, 3]`` at positions ≥ ``first``, sorted (layer, then
    position, then feature), and their activations ``[k]``, on the CPU."""
    found, values = [], []
    for layer in sorted(model.layers):
        activations = model.layers[layer].activations[0]
        nonzero = activations.nonzero()
        nonzero = nonzero[nonzero[:, 0] >= first]
        values.append(activations[tuple(nonzero.T)].float().cpu())
        found.append(torch.cat([torch.full((len(nonzero), 1), layer), nonzero.cpu()], 1))
    return torch.cat(found).long(), torch.cat(values)


def attribute(model: ReplacementModel, *, max_feature_nodes: int | None = DEFAULT_MAX_FEATURE_NODES,
              max_n_logits: int = 10, desired_logit_prob: float = 0.95, batch_size: int = 16,
              update_interval: int = 4, max_memory_bytes: int | None = None, zero_first_position: bool = True,
              completeness_tolerance: float | None = None) -> AttributionGraph:
    """The unpruned attribution graph of ``model``'s prompt (module docstring): one forward pass of ``batch``
    copies of the prompt, then one backward pass per ``batch`` targets: the logits first, then at most
    ``max_feature_nodes`` features chosen by influence (:func:`~gradpatch.circuits.select.feature_rounds`); only
    those features' rows are computed, and the graph keeps them alone.

    Args:
        model: the local replacement model of the prompt (on the device it runs on).
        max_feature_nodes: the feature nodes kept, at most (circuit-tracer's ``max_feature_nodes``; default 7,500,
            its command's default); ``None``: every active feature.
        max_n_logits, desired_logit_prob: the logit nodes (circuit-tracer's defaults 10 and 0.95).
        batch_size: targets per backward pass (rows of the forward pass), at most; with ``update_interval``, the
            features chosen per round (``update_interval · batch_size``, whatever ``max_memory_bytes`` makes of the
            backward passes, so that the features chosen do not depend on the bound).
        update_interval: backward passes of ``batch_size`` per round of the choice (circuit-tracer's, 4).
        max_memory_bytes: a bound on the bytes held on the model's device (:func:`memory_per_row`); the batch is
            made smaller to fit it. ``None``: no bound.
        zero_first_position: circuit-tracer's convention (module docstring): no feature node at position 0, the
            error nodes at position 0 without edges, their contributions in the biases. ``False``: position 0's
            features and errors are nodes like any other position's.
        completeness_tolerance: the largest error of a logit row, relative to its Σ|terms|
            (:func:`~gradpatch.circuits.complete.check_completeness`); ``None``: its ``default_tolerance`` of the
            model's dtype (1e-4 in float32).

    Returns:
        An :class:`AttributionGraph` (rows ``[n_features + n_logits, n]`` in float32 on the CPU, moved there as they
        are made).

    Raises:
        CircuitError: ``batch_size``, ``update_interval`` or ``max_feature_nodes`` below 1.
        MemoryBoundError: ``max_memory_bytes`` too small for one row.
        IncompleteGraphError: a target row whose edges and bias do not sum to its value within
            ``completeness_tolerance`` (a nonlinearity neither frozen nor linearised); the message names the node.
    """
    for name, value in (("batch_size", batch_size), ("update_interval", update_interval),
                        ("max_feature_nodes", 1 if max_feature_nodes is None else max_feature_nodes)):
        if value < 1:
            raise CircuitError(f"{name}={value}: give at least 1 (max_feature_nodes=None keeps every feature)")
    layers = sorted(model.layers)
    first = int(zero_first_position)
    active, activations = _active_features(model, first)
    total = len(active)
    limit = total if max_feature_nodes is None else min(max_feature_nodes, total)
    logit_ids, logit_p = salient_logits(model.logits[0, -1], max_n_logits, desired_logit_prob)
    seq, n_logits = model.ids.shape[1], len(logit_ids)
    columns = _Columns(layers, seq, total, total + len(layers) * seq, total + (len(layers) + 1) * seq + n_logits,
                       first)
    n = columns.n_nodes
    logit_nodes = torch.arange(n - n_logits, n)
    batch = plan_batch_size(model, n, limit + n_logits, batch_size, max_memory_bytes)
    rows = torch.zeros(limit + n_logits, n)  # the visited features' rows in visiting order, then the logits'
    sources = _sources(model, active, activations)
    forward = RetainedForward(model, batch)
    logits = [Target("logit", 0, 0, t) for t in logit_ids.tolist()]
    _fill_rows(model, forward, batch, columns, sources, logits, rows[limit:])
    weights = torch.zeros(n)
    weights[logit_nodes] = logit_p.float().cpu()
    order, done = [], 0
    for chosen in feature_rounds(rows, logit_nodes, weights, total, update_interval * batch_size):
        features = [Target("feature", l, p, f) for l, p, f in active[chosen].tolist()]
        _fill_rows(model, forward, batch, columns, sources, features, rows[done:done + len(chosen)])
        order.append(chosen)
        done += len(chosen)
    del forward  # its kept autograd graph, before the check's forward pass
    visited = torch.cat(order)
    if limit < total:  # keep the visited features, in node order: their rows and columns, and the other nodes'
        kept = torch.sort(visited)
        keep = torch.cat([kept.values, torch.arange(total, n)])
        order_of_rows = torch.cat([kept.indices, torch.arange(limit, limit + n_logits)])
        gathered = torch.empty(len(order_of_rows), len(keep))
        for start in range(0, len(order_of_rows), 64):  # a few rows at a time: no index tensor of the result's size
            gathered[start:start + 64] = rows[order_of_rows[start:start + 64]].index_select(1, keep)
        rows = gathered
        active, activations = active[kept.values], activations[kept.values]
    graph = AttributionGraph(model.ids[0].cpu(), layers, active, activations, logit_ids.cpu(), logit_p.cpu(), rows,
                             zero_first_position=zero_first_position, total_features=total)
    graph.nodes = ([model.layers[int(l)].output_node for l in active[:, 0].tolist()]
                   + [model.layers[l].output_node for l in layers for _ in range(seq)]
                   + [model.embed] * seq + ["output|logits"] * n_logits)
    check_completeness(model, graph, completeness_tolerance)
    return graph
