"""The completeness check of an attribution graph: each target is the sum of its incoming edges plus its bias.

In the local replacement model every target (a feature's pre-activation h_ℓpf, a logit's logit_t − mean_v logit_v)
is an affine function of the sources' contributions, so the attributions are complete (Ameisen et al. 2025,
"Circuit Tracing", section 2.2: the local replacement model reproduces the model's output exactly and is linear in
the sources once attention patterns and normalisation scales are frozen; circuit-tracer's attributions are exact in
the same sense):

    target = Σ_s A[target, s] + bias(target),

where bias(target) is what is held fixed: the target's value with every source of the graph removed (δ_ℓ =
−(e_ℓ + Σ_f a_ℓf W_dec[f]) over the graph's error and feature nodes at ℓ, at the positions that have nodes,
δ_E = −E; :mod:`gradpatch.circuits.attribute`). With every active feature a node this is δ_ℓ = −(c_ℓ − b_dec); the
active features that ``max_feature_nodes`` leaves out are no sources, and their contributions stay in the bias. A
nonlinearity that is neither frozen nor linearised (:mod:`gradpatch.circuits.freeze`) breaks the equality;
:func:`check_completeness` measures it with one more forward pass of the replacement model and refuses a graph whose
error exceeds ``tolerance`` · (Σ_s |A[t, s]| + |bias(t)|) in a logit row (float rounding between large terms stays
well within 1e-4 in float32).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .clt_layers import CLTLayerView
from .errors import IncompleteGraphError
from .graph import AttributionGraph
from .replacement import ReplacementModel

__all__ = ["Completeness", "check_completeness", "completeness", "decoder_blocks", "default_tolerance",
           "removed_sources"]


@dataclass(frozen=True)
class Completeness:
    """Each target row's completeness terms (float32, on the CPU).

    Attributes:
        rows: the node index of each target row (the graph's ``target_nodes``), features then logits
            ``[n_targets]``.
        values: the targets' values on the prompt ``[n_targets]``.
        edges: Σ_s A[t, s] ``[n_targets]``.
        biases: bias(t), the target with every source removed ``[n_targets]``.
        scales: Σ_s |A[t, s]| + |bias(t)|, the size of the terms summed ``[n_targets]``.
    """

    rows: torch.Tensor
    values: torch.Tensor
    edges: torch.Tensor
    biases: torch.Tensor
    scales: torch.Tensor

    @property
    def errors(self) -> torch.Tensor:
        """|value − Σ edges − bias| / scale per target ``[n_targets]`` (0 where every term is 0)."""
        return (self.values - self.edges - self.biases).abs() / self.scales.clamp_min(torch.finfo(torch.float32).tiny)


def completeness(model: ReplacementModel, graph: AttributionGraph) -> Completeness:
    """The :class:`Completeness` of every target row of ``graph`` (features, then logits), built on ``model``: one
    forward pass of the replacement model with every source removed gives the biases; the values are the recorded
    pre-activations and logits (the replacement model replays them bit for bit).

    Returns:
        A :class:`Completeness`, tensors ``[n_features + n_logits]``.
    """
    values = torch.zeros(graph.n_features + len(graph.logit_tokens))
    biases = torch.zeros_like(values)
    with torch.no_grad():
        removed = model.run(1, removed_sources(model, graph), -model.embeddings)
        for layer in graph.layers:
            spliced = model.layers[layer]
            chosen = (graph.active_features[:, 0] == layer).nonzero().squeeze(-1)
            where = (0, *graph.active_features[chosen, 1:].to(spliced.inputs.device).T)
            values[chosen] = spliced.transcoder.pre_activations(spliced.inputs)[where].float().cpu()
            biases[chosen] = removed.pre_activations[layer][where].float().cpu()
        tokens = graph.logit_tokens.to(model.logits.device)
        for target, logits in ((values, model.logits), (biases, removed.logits)):
            last = logits[0, -1].float()
            target[graph.n_features:] = (last[tokens] - last.mean()).cpu()
    rows = graph.rows
    return Completeness(graph.target_nodes, values, rows.sum(1), biases, rows.abs().sum(1) + biases.abs())


def decoder_blocks(model: ReplacementModel, layer: int) -> list[tuple[int, torch.Tensor]]:
    """The layers whose MLP outputs layer ``layer``'s features write, each with the decoder ``[m, d_out]`` into it
    (detached): a transcoder writes its own MLP output only, a cross-layer transcoder's layer every later one
    (:meth:`~gradpatch.circuits.clt_layers.CLTLayerView.decoder_blocks`). The edges
    (:mod:`gradpatch.circuits.attribute`), the biases here, the source perturbations
    (:mod:`gradpatch.circuits.sources`) and the features' top logits read the decoders from it alone."""
    transcoder = model.layers[layer].transcoder
    if isinstance(transcoder, CLTLayerView):
        return transcoder.decoder_blocks()
    return [(layer, transcoder.W_dec.detach())]


def removed_sources(model: ReplacementModel, graph: AttributionGraph) -> dict[int, torch.Tensor]:
    """δ_ℓ ``[1, seq, d_out]`` per spliced layer that remove every error and feature source of ``graph`` (module
    docstring): −e_ℓ at the positions with error nodes (≥ 1 with ``graph.zero_first_position``), −a_f W_dec[f] at
    each feature node's position, through each of its :func:`decoder_blocks`."""
    first = int(graph.zero_first_position)
    deltas = {}
    for layer, spliced in model.layers.items():
        delta = -spliced.errors
        delta[:, :first] = 0
        deltas[layer] = delta
    device = model.embeddings.device
    features, activations = graph.active_features.to(device), graph.activations.to(device)
    for layer in graph.layers:
        chosen = (features[:, 0] == layer).nonzero().squeeze(-1)
        positions, ids, values = features[chosen, 1], features[chosen, 2], activations[chosen]
        for written, decoder in decoder_blocks(model, layer):
            delta = deltas[written]
            delta[0].index_add_(0, positions, -(values[:, None] * decoder[ids].float()).to(delta.dtype))
    return deltas


def check_completeness(model: ReplacementModel, graph: AttributionGraph, tolerance: float | None = None) -> None:
    """Refuse ``graph`` unless every logit row is complete: |value − Σ_s A[t, s] − bias| ≤ ``tolerance`` ·
    (Σ_s |A[t, s]| + |bias|) (module docstring). The logits depend on every frozen or linearised node, so a
    nonlinearity left live anywhere shows in their rows. Feature rows are not checked: a pre-activation
    h = x W_enc + b_enc near 0 is itself a difference of larger terms, whose rounding the criterion does not scale
    with (measured: 8.7e-4 of Σ|terms| on a random GPT-NeoX's layer-0 features, whose one source is their token,
    where the logit rows' error is 3e-7); :func:`completeness` gives them.

    Args:
        model: the replacement model ``graph`` was built on.
        graph: the unpruned graph, every logit row computed.
        tolerance: relative to Σ|terms|; ``None``: :func:`default_tolerance` of the model's dtype.

    Raises:
        IncompleteGraphError: a logit row above the tolerance; the message names the worst one's token, its error
            and the terms.
    """
    found = completeness(model, graph)
    tolerance = default_tolerance(model.embeddings.dtype) if tolerance is None else tolerance
    errors = found.errors[graph.n_features:]
    if not len(errors) or float(errors.max()) <= tolerance:
        return
    worst = int(errors.argmax())
    index = graph.n_features + worst
    raise IncompleteGraphError(
        f"the attribution graph is not complete: logit node {int(found.rows[index])} (token "
        f"{int(graph.logit_tokens[worst])} at the last position) has value {float(found.values[index]):.6g}, but its "
        f"edges sum to {float(found.edges[index]):.6g} and its bias is {float(found.biases[index]):.6g}: an error of "
        f"{float(errors[worst]):.3g} of Σ|terms| = {float(found.scales[index]):.6g}, above the tolerance {tolerance:g} "
        f"({int((errors > tolerance).sum())} of {len(errors)} logit rows). A nonlinearity between the sources and the "
        f"logits is neither frozen nor linearised (find_frozen_nodes(pg) lists what is): freeze it by hand")


def default_tolerance(dtype: torch.dtype) -> float:
    """The completeness tolerance (relative to Σ|terms|) for a model computing in ``dtype``: max(1e-4, 4 ε(dtype)),
    i.e. 1e-4 in float32 and float64, 3.1e-2 in bfloat16, 3.9e-3 in float16. Measured on the tiny random Llama,
    Gemma 2 and GPT-2 (2 layers, 64 wide) on the CPU, the logit rows' largest error is 4e-7 in float32, 4e-3 in
    bfloat16 and 6e-4 in float16 (about ε/2). Half-precision tolerances cannot tell an error this small from a
    live nonlinearity's (a soft-capping left live: 1e-2 in float32); run in float32 for an exact check."""
    return max(1e-4, 4 * torch.finfo(dtype).eps)
