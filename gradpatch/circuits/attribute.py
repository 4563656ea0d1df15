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
fits ``max_memory_bytes`` where given (:func:`memory_per_row`). Adjacency: ``[n, n]``, rows = targets, columns =
sources, on the CPU (each batch's rows moved there as they are made). A graph whose rows do not sum to their targets
(edges + bias) is refused (:func:`~gradpatch.circuits.complete.check_completeness`), never returned.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .backward import RetainedForward, Target, measure_saved_bytes
from .complete import check_completeness
from .errors import CircuitError, MemoryBoundError
from .graph import AttributionGraph
from .replacement import ReplacementModel

__all__ = ["FEATURE_CHUNK", "AttributionGraph", "attribute", "memory_per_row", "plan_batch_size", "salient_logits"]

#: Feature sources whose gradients are gathered at once when the edges are contracted.
FEATURE_CHUNK = 1024


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


def _sources(graph: AttributionGraph, device: torch.device) -> dict[int, _Sources]:
    """Each spliced layer's :class:`_Sources`, from ``graph``'s feature nodes."""
    features, activations = graph.active_features.to(device), graph.activations.to(device)
    found = {}
    for layer in graph.layers:
        columns = (features[:, 0] == layer).nonzero().squeeze(-1)
        found[layer] = _Sources(columns, features[columns, 1], features[columns, 2], activations[columns])
    return found


def _edges(model: ReplacementModel, graph: AttributionGraph, sources: dict[int, _Sources],
           gradients: dict[int, torch.Tensor], embed_gradient: torch.Tensor) -> torch.Tensor:
    """The rows ``[batch, n]`` of the adjacency from each row's gradients at the MLP outputs ``[batch, seq, d_out]``
    (layers absent: zero) and the embeddings ``[batch, seq, d_model]``: A[t, s] = g · contribution, for all sources
    of a layer at once (feature sources in chunks of :data:`FEATURE_CHUNK`), as a product and a sum over d, whose
    rows do not depend on the batch (a batched matmul's rounding does). With ``graph.zero_first_position`` the
    error nodes at position 0 get no edges."""
    first = int(graph.zero_first_position)
    batch = embed_gradient.shape[0]
    rows = torch.zeros(batch, graph.adjacency.shape[1], dtype=torch.float32, device=embed_gradient.device)
    for index, layer in enumerate(graph.layers):
        if layer not in gradients:
            continue
        spliced, found = model.layers[layer], sources[layer]
        grad = gradients[layer].float()  # [batch, seq, d_out]
        for start in range(0, len(found.columns), FEATURE_CHUNK):
            part = slice(start, start + FEATURE_CHUNK)
            directions = spliced.transcoder.W_dec.detach()[found.ids[part]].float()  # [k, d_out]
            edges = (grad[:, found.positions[part]] * directions).sum(-1)
            rows[:, found.columns[part]] = edges * found.activations[part]
        start = graph.error_start + index * graph.n_pos
        rows[:, start + first:start + graph.n_pos] = (grad[:, first:] * spliced.errors[:, first:].float()).sum(-1)
    rows[:, graph.token_start:graph.logit_start] = (embed_gradient.float() * model.embeddings.float()).sum(-1)
    return rows


def plan_batch_size(model: ReplacementModel, n_nodes: int, n_targets: int, batch_size: int,
                    max_memory_bytes: int | None) -> int:
    """Targets per backward pass: ``batch_size``, at most ``n_targets``, and, with ``max_memory_bytes``, at most
    what fits in it (:func:`memory_per_row`).

    Raises:
        MemoryBoundError: ``max_memory_bytes`` does not hold one row (the message gives the bytes needed).
    """
    batch = max(1, min(batch_size, n_targets))
    if max_memory_bytes is None:
        return batch
    fixed, per_row = memory_per_row(model, n_nodes)
    fits = (max_memory_bytes - fixed) // per_row
    if fits < 1:
        raise MemoryBoundError(f"max_memory_bytes={max_memory_bytes} holds no row: one row of {n_nodes} nodes needs "
                               f"{fixed + per_row} bytes ({fixed} whatever the batch, {per_row} per row); raise "
                               f"the bound or shorten the prompt")
    return int(min(batch, fits))


def memory_per_row(model: ReplacementModel, n_nodes: int) -> tuple[int, int]:
    """An estimate of the bytes :func:`attribute` holds on the model's device beyond the model's and transcoders'
    parameters and the replacement model's recorded values, (fixed, per row of the batch).

    Per row: what the forward pass keeps for backward passes and its peak above that (measured,
    :func:`~gradpatch.circuits.backward.measure_saved_bytes`); the kept MLP outputs and embeddings, the gradients
    read from them and the gradients injected (each ``[seq, Σ widths]``); the batch's adjacency row ``[n]``
    (float32); a chunk of gathered gradients and their products ``2 × [FEATURE_CHUNK, d_out]``; and a backward
    pass's working gradients, taken as 8 ``[seq, d_model]``. Fixed: what the forward pass keeps whatever the batch,
    plus the adjacency ``[n, n]`` (float32) when the model is on the CPU (elsewhere the rows are moved to the CPU as
    they are made).
    """
    saved = measure_saved_bytes(model)
    seq = model.ids.shape[1]
    itemsize = model.embeddings.element_size()
    d_model = model.embeddings.shape[-1]
    widths = sum(s.transcoder.d_out + s.transcoder.d_in for s in model.layers.values()) + d_model
    d_out = max(s.transcoder.d_out for s in model.layers.values())
    per_row = (saved.per_row + saved.transient_per_row + 2 * seq * widths * itemsize + 4 * n_nodes
               + 2 * FEATURE_CHUNK * d_out * 4 + 8 * seq * d_model * itemsize)
    fixed = saved.fixed + (4 * n_nodes * n_nodes if model.embeddings.device.type == "cpu" else 0)
    return fixed, per_row


def attribute(model: ReplacementModel, *, max_n_logits: int = 10, desired_logit_prob: float = 0.95,
              batch_size: int = 16, max_memory_bytes: int | None = None,
              zero_first_position: bool = True, completeness_tolerance: float | None = None) -> AttributionGraph:
    """The unpruned attribution graph of ``model``'s prompt (module docstring): one forward pass of ``batch``
    copies of the prompt, then one backward pass per ``batch`` targets.

    Args:
        model: the local replacement model of the prompt (on the device it runs on).
        max_n_logits, desired_logit_prob: the logit nodes (circuit-tracer's defaults 10 and 0.95).
        batch_size: targets per backward pass (rows of the forward pass), at most.
        max_memory_bytes: a bound on the bytes held on the model's device (:func:`memory_per_row`); the batch is
            made smaller to fit it. ``None``: no bound.
        zero_first_position: circuit-tracer's convention (module docstring): no feature node at position 0, the
            error nodes at position 0 without edges, their contributions in the biases. ``False``: position 0's
            features and errors are nodes like any other position's.
        completeness_tolerance: the largest error of a logit row, relative to its Σ|terms|
            (:func:`~gradpatch.circuits.complete.check_completeness`); ``None``: its ``default_tolerance`` of the
            model's dtype (1e-4 in float32).

    Returns:
        An :class:`AttributionGraph` (adjacency ``[n, n]`` in float32 on the CPU, rows moved there as they are made).

    Raises:
        CircuitError: ``batch_size`` below 1.
        MemoryBoundError: ``max_memory_bytes`` too small for one row.
        IncompleteGraphError: a target row whose edges and bias do not sum to its value within
            ``completeness_tolerance`` (a nonlinearity neither frozen nor linearised); the message names the node.
    """
    if batch_size < 1:
        raise CircuitError(f"batch_size={batch_size}: give at least 1 target per backward pass")
    layers = sorted(model.layers)
    first = int(zero_first_position)
    found = [torch.cat([torch.full((len(nz), 1), layer), nz], 1)
             for layer in layers for nz in [model.layers[layer].activations[0].nonzero().cpu()]]
    found = [entries[entries[:, 1] >= first] for entries in found]
    active = torch.cat(found).long() if found else torch.zeros(0, 3, dtype=torch.long)
    activations = torch.cat([torch.zeros(0)] + [model.layers[layer].activations[0][tuple(entries[:, 1:].to(
        model.embeddings.device).T)].float().cpu() for layer, entries in zip(layers, found)])
    logit_ids, logit_p = salient_logits(model.logits[0, -1], max_n_logits, desired_logit_prob)
    seq = model.ids.shape[1]
    n = len(active) + len(layers) * seq + seq + len(logit_ids)
    targets = ([Target("feature", l, p, f) for l, p, f in active.tolist()]
               + [Target("logit", 0, 0, t) for t in logit_ids.tolist()])
    batch = plan_batch_size(model, n, len(targets), batch_size, max_memory_bytes)
    graph = AttributionGraph(model.ids[0].cpu(), layers, active, activations.cpu(), logit_ids.cpu(),
                             logit_p.cpu(), torch.zeros(n, n), zero_first_position=zero_first_position)
    graph.nodes = ([model.layers[int(l)].output_node for l in active[:, 0].tolist()]
                   + [model.layers[l].output_node for l in layers for _ in range(seq)]
                   + [model.embed] * seq + ["output|logits"] * len(logit_ids))
    target_rows = torch.cat([torch.arange(len(active)), torch.arange(graph.logit_start, n)])
    sources = _sources(graph, model.embeddings.device)
    forward = RetainedForward(model, batch)
    for start in range(0, len(targets), batch):
        chunk = targets[start:start + batch]
        gradients, embed_gradient = forward.gradients(chunk)
        rows = _edges(model, graph, sources, {layer: g[:len(chunk)] for layer, g in gradients.items()},
                      embed_gradient[:len(chunk)])
        graph.adjacency[target_rows[start:start + len(chunk)]] = rows.cpu()
    del forward  # its kept autograd graph, before the check's forward pass
    check_completeness(model, graph, completeness_tolerance)
    return graph
