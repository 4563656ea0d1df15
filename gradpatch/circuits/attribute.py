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

The gradients g come from one forward pass of the replacement model on the prompt, kept for backward passes of up
to ``batch`` targets each, vectorised over the targets (:mod:`gradpatch.circuits.backward`, circuit-tracer's method
without its ``batch`` copies of the forward pass); the targets share passes by layer and position, and those before
the last positions are served by forward passes of the prompt's first positions, whose backward passes are shorter
(:mod:`gradpatch.circuits.batches`); the edges are contracted by position (:mod:`gradpatch.circuits.edges`). The
batch fits ``max_memory_bytes`` where given (:func:`memory_per_row`). The logit rows come first; then the features are
visited in circuit-tracer's rounds (:func:`~gradpatch.circuits.select.feature_rounds`), at most ``max_feature_nodes``
of them, and only the visited features' rows are computed; the graph keeps those features as its feature nodes. Only
the targets' rows are held (:class:`~gradpatch.circuits.graph.AttributionGraph`: ``rows`` ``[n_targets, n]``, columns
= sources, float32 on the CPU, each batch's rows moved there as they are made). A graph whose rows do not sum to
their targets (edges + bias) is refused (:func:`~gradpatch.circuits.complete.check_completeness`), never returned.
"""

from __future__ import annotations

import torch

from .backward import RetainedForward, Target, measure_saved_bytes
from .batches import causal, choose_lengths, plan_batches
from .complete import check_completeness
from .edges import FEATURE_CHUNK, SourceBlock, edges, source_blocks
from .errors import CircuitError, MemoryBoundError
from .graph import AttributionGraph
from .replacement import ReplacementModel
from .select import feature_rounds

__all__ = ["DEFAULT_MAX_FEATURE_NODES", "FEATURE_CHUNK", "AttributionGraph", "attribute", "memory_per_row",
           "plan_batch_size", "salient_logits"]

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


def _fill_rows(model: ReplacementModel, forward: RetainedForward, blocks: list[SourceBlock], n_nodes: int,
               targets: list[Target], into: torch.Tensor, prefixes: bool) -> None:
    """Compute the rows of ``targets`` into ``into`` ``[len(targets), n]`` (on the CPU), at most ``forward.batch``
    targets per backward pass (:func:`~gradpatch.circuits.edges.edges`): the passes of
    :func:`~gradpatch.circuits.batches.plan_batches`, on ``forward`` (the whole prompt) or, with ``prefixes``, on
    forward passes of the prompt's first positions (:func:`~gradpatch.circuits.batches.choose_lengths`), each run
    when its targets come and freed after them."""
    seq = model.ids.shape[1]
    lengths = choose_lengths(targets, seq, forward.batch) if prefixes else [seq]
    shorter: RetainedForward | None = None
    for length, indices in plan_batches(targets, lengths, forward.batch):
        if length != seq and (shorter is None or shorter.length != length):
            shorter = None  # the previous length's kept graph, before the next one's forward pass
            shorter = RetainedForward(model, forward.batch, length)
        served = forward if length == seq else shorter
        gradients, embed_gradient = served.gradients([targets[i] for i in indices])
        into[torch.tensor(indices)] = edges(blocks, gradients, embed_gradient, n_nodes).cpu()


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
    parameters and the replacement model's recorded values, (fixed, per row of a backward pass).

    Fixed: what the forward pass of the prompt keeps for backward passes beyond the recording, twice (a forward pass
    of its first positions is held beside it, one at a time, and keeps no more), and its peak above that (measured,
    :func:`~gradpatch.circuits.backward.measure_saved_bytes`); the recorded attention patterns once more (that
    shorter pass multiplies by cut copies of them, at most their size); the source vectors of a chunk ``[FEATURE_CHUNK,
    d_out]`` (float32); and, when the model is on the CPU (elsewhere the rows are moved to the CPU as they are
    made), twice the rows held ``[n_rows, n]`` (float32): the rows, and either their normalised copy while the
    features are chosen (:func:`~gradpatch.circuits.select.feature_rounds`) or the graph's rows gathered from them
    at the end. Per row: the gradients read from the MLP outputs and the embeddings and those injected (each at most
    ``[seq, Σ widths]``); the row ``[n]`` (float32); a chunk's products, twice ``[FEATURE_CHUNK]``, and a copy of
    one gradient ``[seq, d_out]`` (float32); and a backward pass's working gradients, taken as 8 ``[seq,
    d_model]``.

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
    per_row = (2 * seq * widths * itemsize + 4 * n_nodes + 2 * FEATURE_CHUNK * 4 + seq * d_out * 4
               + 8 * seq * d_model * itemsize)
    patterns = sum(pattern.untyped_storage().nbytes() for _, pattern in model.pattern_values)
    fixed = (2 * saved.kept + saved.transient + patterns + FEATURE_CHUNK * d_out * 4
             + (2 * 4 * n_rows * n_nodes if model.embeddings.device.type == "cpu" else 0))
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
    """The unpruned attribution graph of ``model``'s prompt (module docstring): a forward pass of the prompt, then
    backward passes of up to ``batch`` targets each: the logits first, then at most
    ``max_feature_nodes`` features chosen by influence (:func:`~gradpatch.circuits.select.feature_rounds`); only
    those features' rows are computed, and the graph keeps them alone.

    Args:
        model: the local replacement model of the prompt (on the device it runs on).
        max_feature_nodes: the feature nodes kept, at most (circuit-tracer's ``max_feature_nodes``; default 7,500,
            its command's default); ``None``: every active feature.
        max_n_logits, desired_logit_prob: the logit nodes (circuit-tracer's defaults 10 and 0.95).
        batch_size: targets per backward pass, at most; with ``update_interval``, the
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
    n = total + (len(layers) + 1) * seq + n_logits
    logit_nodes = torch.arange(n - n_logits, n)
    batch = plan_batch_size(model, n, limit + n_logits, batch_size, max_memory_bytes)
    rows = torch.zeros(limit + n_logits, n)  # the visited features' rows in visiting order, then the logits'
    blocks = source_blocks(model, active, activations, total, total + len(layers) * seq, n, first)
    forward = RetainedForward(model, batch)
    prefixes = causal(model)
    logits = [Target("logit", 0, 0, t) for t in logit_ids.tolist()]
    _fill_rows(model, forward, blocks, n, logits, rows[limit:], prefixes)
    weights = torch.zeros(n)
    weights[logit_nodes] = logit_p.float().cpu()
    order, done = [], 0
    for chosen in feature_rounds(rows, logit_nodes, weights, total, update_interval * batch_size):
        features = [Target("feature", l, p, f) for l, p, f in active[chosen].tolist()]
        _fill_rows(model, forward, blocks, n, features, rows[done:done + len(chosen)], prefixes)
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
