"""The attribution graph of one prompt: nodes and the direct-effect adjacency matrix (Ameisen et al. 2025, "Circuit
Tracing", sections 2.3–2.4; circuit-tracer's ``attribute``).

Nodes, in circuit-tracer's order: the active features (layer ℓ, position p, feature f) with a_ℓpf ≠ 0, sorted;
the error nodes (ℓ, p), layer-major; the token embeddings (p); the top output logits at the last position, by
probability until their cumulative probability reaches ``desired_logit_prob`` (at most ``max_n_logits``).

Edges are direct effects in the local replacement model (:mod:`gradpatch.circuits.replacement`), which is affine,
so every target is the sum of its sources' contributions plus a constant (biases):

- a feature target's value is its pre-activation h_ℓpf = x_ℓp · W_enc[:, f] + b_enc[f];
- a logit target's value is logit_t − mean_v logit_v at the last position (circuit-tracer's demeaned unembedding);
- a source's contribution is a vector added to the residual stream: a_ℓ'p'f' W_dec[f'] for a feature, e_ℓ'p' for an
  error, the embedding E_p' for a token. With g = ∂target/∂(MLP output of ℓ' at p') (or ∂target/∂E_p'), the edge is

      A[target, source] = g · contribution.

The gradients g of ``batch_size`` targets come from one forward and one backward pass: each row of the batch is a
copy of the prompt, whose target is one node's value; the rows' values are summed, and the gradient of the sum
with respect to zero perturbations δ ``[batch, seq, d_model]`` at every MLP output and at the embeddings gives each
row's g. Adjacency: ``[n, n]``, rows = targets, columns = sources.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .errors import CircuitError
from .replacement import ReplacementModel, ReplacementRun

__all__ = ["AttributionGraph", "attribute", "salient_logits"]


@dataclass
class AttributionGraph:
    """An unpruned attribution graph.

    Attributes:
        input_tokens: the prompt's ids ``[seq]``.
        layers: the spliced layers, ascending (error nodes come in this order).
        active_features: (layer, position, feature) of each feature node ``[n_features, 3]``.
        activations: a of each feature node ``[n_features]``.
        logit_tokens: the logit nodes' token ids ``[n_logits]``.
        logit_probabilities: their probabilities ``[n_logits]``.
        adjacency: ``[n, n]``, rows = targets, columns = sources, n = n_features + len(layers)·seq + seq + n_logits.
        nodes: NodePath of each node (a feature's and error's: the MLP output it writes; a token's: the
            embeddings; a logit's: the logits).
    """

    input_tokens: torch.Tensor
    layers: list[int]
    active_features: torch.Tensor
    activations: torch.Tensor
    logit_tokens: torch.Tensor
    logit_probabilities: torch.Tensor
    adjacency: torch.Tensor
    nodes: list[str] = field(default_factory=list)

    @property
    def n_features(self) -> int:
        return int(self.active_features.shape[0])

    @property
    def n_pos(self) -> int:
        return int(self.input_tokens.shape[0])

    @property
    def error_start(self) -> int:
        return self.n_features

    @property
    def token_start(self) -> int:
        return self.n_features + len(self.layers) * self.n_pos

    @property
    def logit_start(self) -> int:
        return self.token_start + self.n_pos


def salient_logits(logits: torch.Tensor, max_n_logits: int = 10,
                   desired_logit_prob: float = 0.95) -> tuple[torch.Tensor, torch.Tensor]:
    """The smallest set of top tokens whose cumulative probability reaches ``desired_logit_prob``, at most
    ``max_n_logits`` (circuit-tracer's ``compute_salient_logits``): ids ``[k]`` and probabilities ``[k]`` of the
    last position's ``logits`` ``[vocab]``."""
    probabilities = torch.softmax(logits.float(), dim=-1)
    top_p, top_ids = torch.topk(probabilities, min(max_n_logits, probabilities.shape[-1]))
    cutoff = int(torch.searchsorted(torch.cumsum(top_p, 0), desired_logit_prob)) + 1
    return top_ids[:cutoff], top_p[:cutoff]


def _targets(run: ReplacementRun, specs: list[tuple[str, int, int, int]]) -> torch.Tensor:
    """Row b's target value ``[batch]``: ("feature", ℓ, p, f) -> h_ℓpf; ("logit", t, 0, 0) -> demeaned logit t."""
    values = []
    for row, (kind, a, b, c) in enumerate(specs):
        if kind == "feature":
            values.append(run.pre_activations[a][row, b, c])
        else:
            last = run.logits[row, -1]
            values.append(last[a] - last.mean())
    return torch.stack(values)


def _edges(model: ReplacementModel, graph: AttributionGraph, gradients: dict[int, torch.Tensor],
           embed_gradient: torch.Tensor) -> torch.Tensor:
    """The rows ``[batch, n]`` of the adjacency from each row's gradients at the MLP outputs and the embeddings."""
    batch = embed_gradient.shape[0]
    device = embed_gradient.device
    rows = torch.zeros(batch, graph.adjacency.shape[1], dtype=graph.adjacency.dtype, device=device)
    features, activations = graph.active_features.to(device), graph.activations.to(device)
    for index, layer in enumerate(graph.layers):
        spliced = model.layers[layer]
        grad = gradients[layer].float()  # [batch, seq, d_out]
        chosen = (features[:, 0] == layer).nonzero().squeeze(-1)
        if chosen.numel():
            positions, ids = features[chosen, 1], features[chosen, 2]
            directions = spliced.transcoder.W_dec[ids].detach().float()  # [k, d_out]
            rows[:, chosen] = (grad[:, positions] * directions).sum(-1) * activations[chosen]
        start = graph.error_start + index * graph.n_pos
        rows[:, start:start + graph.n_pos] = (grad * spliced.errors.float()).sum(-1)
    rows[:, graph.token_start:graph.logit_start] = (embed_gradient.float() * model.embeddings.float()).sum(-1)
    return rows


def attribute(model: ReplacementModel, *, max_n_logits: int = 10, desired_logit_prob: float = 0.95,
              batch_size: int = 16) -> AttributionGraph:
    """The unpruned attribution graph of ``model``'s prompt (module docstring).

    Args:
        model: the local replacement model of the prompt.
        max_n_logits, desired_logit_prob: the logit nodes (circuit-tracer's defaults 10 and 0.95).
        batch_size: targets per forward and backward pass.

    Returns:
        An :class:`AttributionGraph` (adjacency in float32 on the CPU).

    Raises:
        CircuitError: ``batch_size`` below 1.
    """
    if batch_size < 1:
        raise CircuitError(f"batch_size={batch_size}: give at least 1 target per backward pass")
    layers = sorted(model.layers)
    found = [torch.cat([torch.full((len(nz), 1), layer), nz], 1)
             for layer in layers for nz in [model.layers[layer].activations[0].nonzero()]]
    active = torch.cat(found).long() if found else torch.zeros(0, 3, dtype=torch.long)
    activations = torch.stack([model.layers[int(l)].activations[0, p, f] for l, p, f in active.tolist()]).float() \
        if len(active) else torch.zeros(0)
    logit_ids, logit_p = salient_logits(model.logits[0, -1], max_n_logits, desired_logit_prob)
    seq = model.ids.shape[1]
    n = len(active) + len(layers) * seq + seq + len(logit_ids)
    graph = AttributionGraph(model.ids[0].cpu(), layers, active.cpu(), activations.cpu(), logit_ids.cpu(),
                             logit_p.cpu(), torch.zeros(n, n))
    graph.nodes = ([model.layers[int(l)].output_node for l in active[:, 0].tolist()]
                   + [model.layers[l].output_node for l in layers for _ in range(seq)]
                   + [model.embed] * seq + ["output|logits"] * len(logit_ids))
    specs = [("feature", l, p, f) for l, p, f in active.tolist()] + [("logit", t, 0, 0) for t in logit_ids.tolist()]
    target_rows = list(range(len(active))) + list(range(graph.logit_start, n))
    for start in range(0, len(specs), batch_size):
        chunk = specs[start:start + batch_size]
        deltas = {layer: torch.zeros(len(chunk), seq, model.layers[layer].transcoder.d_out, requires_grad=True,
                                     device=model.embeddings.device) for layer in layers}
        embed_delta = torch.zeros(len(chunk), *model.embeddings.shape[1:], requires_grad=True,
                                  device=model.embeddings.device)
        with torch.enable_grad():
            total = _targets(model.run(len(chunk), deltas, embed_delta), chunk).sum()
            grads = torch.autograd.grad(total, [*deltas.values(), embed_delta], allow_unused=True)
        grads = [torch.zeros_like(x) if g is None else g for g, x in zip(grads, [*deltas.values(), embed_delta])]
        rows = _edges(model, graph, dict(zip(layers, grads[:-1])), grads[-1])
        graph.adjacency[target_rows[start:start + len(chunk)]] = rows.cpu()
    return graph
