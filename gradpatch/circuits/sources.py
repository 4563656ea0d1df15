"""The source nodes of an attribution graph as vectors in the residual stream: contracting gradients with them, and
perturbations that add a multiple of them (for :mod:`gradpatch.circuits.qk` and :mod:`gradpatch.circuits.heads`).

A source's contribution (Ameisen et al. 2025, section 2.3; docs/circuits.md) is a vector added at one position:
a_ℓpf W_dec[f] to the MLP output of ℓ for a feature (to every MLP output it writes for a cross-layer transcoder's
feature: :func:`~gradpatch.circuits.complete.decoder_blocks`), e_ℓp for an error, E_p to the token embeddings for a
token. The graph's source columns are ``0 .. graph.logit_start − 1`` (features, errors, tokens); with
``graph.zero_first_position`` the error nodes at position 0 contribute nothing (their vectors belong to the bias).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from .complete import decoder_blocks
from .errors import CircuitError
from .graph import AttributionGraph
from .replacement import ReplacementModel

__all__ = ["contract_sources", "source_deltas"]


def contract_sources(model: ReplacementModel, graph: AttributionGraph, gradients: Mapping[int, torch.Tensor],
                     embed_gradient: torch.Tensor) -> torch.Tensor:
    """g · contribution for every source node and every row of the gradients.

    Args:
        model: the replacement model the graph was built on.
        graph: its attribution graph.
        gradients: layer -> ∂(row's quantity)/∂(MLP output) ``[rows, seq, d_out]`` (absent layers: zero).
        embed_gradient: ∂(row's quantity)/∂(token embeddings) ``[rows, seq, d_model]``.

    Returns:
        ``[rows, graph.logit_start]`` in float32, or float64 for a float64 model: column j is source node j's
        g · contribution.
    """
    rows = embed_gradient.shape[0]
    dtype = torch.promote_types(embed_gradient.dtype, torch.float32)
    out = torch.zeros(rows, graph.logit_start, dtype=dtype, device=embed_gradient.device)
    features = graph.active_features.to(embed_gradient.device)
    activations = graph.activations.to(embed_gradient.device, dtype)
    first = int(graph.zero_first_position)
    for index, layer in enumerate(graph.layers):
        columns = (features[:, 0] == layer).nonzero().squeeze(-1)
        for written, block in decoder_blocks(model, layer):
            if written not in gradients:
                continue
            grad, decoder = gradients[written].to(dtype), block.to(dtype)
            for position in features[columns, 1].unique().tolist():
                here = columns[features[columns, 1] == position]
                out[:, here] += (grad[:, position] @ decoder[features[here, 2]].T) * activations[here]
        if layer not in gradients:
            continue
        grad = gradients[layer].to(dtype)
        spliced = model.layers[layer]
        start = graph.error_start + index * graph.n_pos
        out[:, start + first:start + graph.n_pos] = (grad[:, first:] * spliced.errors[:, first:].to(dtype)).sum(-1)
    out[:, graph.token_start:graph.logit_start] = (embed_gradient.to(dtype) * model.embeddings.to(dtype)).sum(-1)
    return out


def source_deltas(model: ReplacementModel, graph: AttributionGraph,
                  rows: Sequence[Mapping[int, float]]) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
    """Perturbations that add, in each row r, Σ_j rows[r][j] · contribution_j to the residual stream.

    Args:
        model: the replacement model the graph was built on.
        graph: its attribution graph.
        rows: per row, source node index -> coefficient (e.g. ``{j: ε}`` to move node j by ε, ``{j: -1.0 for every
            source}`` to remove them all).

    Returns:
        (layer -> δ_ℓ ``[rows, seq, d_out]``, δ_E ``[rows, seq, d_model]``), for
        :meth:`~gradpatch.circuits.replacement.ReplacementModel.run`'s ``deltas`` and ``embed_delta``.

    Raises:
        CircuitError: a node index that is not a source (a logit or out of range).
    """
    embeddings = model.embeddings
    deltas = {layer: torch.zeros(len(rows), *model.layers[layer].errors.shape[1:], dtype=embeddings.dtype,
                                 device=embeddings.device) for layer in graph.layers}
    embed = torch.zeros(len(rows), *embeddings.shape[1:], dtype=embeddings.dtype, device=embeddings.device)
    decoders = {layer: [(written, block.to(embeddings.dtype)) for written, block in decoder_blocks(model, layer)]
                for layer in graph.layers}
    features = graph.active_features.to(embeddings.device)
    activations = graph.activations.to(embeddings.device, embeddings.dtype)
    first = int(graph.zero_first_position)
    for row, coefficients in enumerate(rows):
        nodes = torch.tensor(list(coefficients), dtype=torch.long, device=embeddings.device)
        values = torch.tensor(list(coefficients.values()), dtype=embeddings.dtype, device=embeddings.device)
        if len(nodes) and (int(nodes.min()) < 0 or int(nodes.max()) >= graph.logit_start):
            raise CircuitError(f"a node of {sorted(coefficients)[:3]}... is not a source of the graph (features, "
                               f"errors and tokens are 0 .. {graph.logit_start - 1})")
        is_feature = nodes < graph.error_start
        is_error = (nodes >= graph.error_start) & (nodes < graph.token_start)
        is_token = nodes >= graph.token_start
        for index, layer in enumerate(graph.layers):
            chosen = is_feature & (features[nodes.clamp(max=graph.error_start - 1).clamp(min=0), 0] == layer) \
                if graph.error_start else torch.zeros_like(is_feature)
            found = features[nodes[chosen]]
            for written, decoder in decoders[layer]:
                scaled = (values[chosen] * activations[nodes[chosen]])[:, None] * decoder[found[:, 2]]
                deltas[written][row].index_add_(0, found[:, 1], scaled)
            errors = nodes[is_error] - graph.error_start
            mine = (errors // graph.n_pos == index) & (errors % graph.n_pos >= first)
            positions = errors[mine] % graph.n_pos
            deltas[layer][row].index_add_(0, positions, values[is_error][mine][:, None]
                                          * model.layers[layer].errors[0, positions])
        positions = nodes[is_token] - graph.token_start
        embed[row].index_add_(0, positions, values[is_token][:, None] * embeddings[0, positions])
    return deltas, embed
