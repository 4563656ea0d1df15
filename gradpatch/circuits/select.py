"""At most N feature nodes: circuit-tracer's ``max_feature_nodes``, the features of greatest influence on the logits.

circuit-tracer (``attribution._run_attribution``, phase 4) computes the logit rows first, then visits features in
rounds: each round ranks the unvisited features by their influence on the logits through the rows computed so far
(``compute_partial_influences``: w Â_r + w Â_r² + … with Â_r = |A| row-normalised over the rows computed), takes the
next ``update_interval · batch_size`` of them (4 · batch_size by default), and computes their rows; it stops after
``max_feature_nodes`` features. The graph keeps the visited features, in their original order; the columns of the
others are dropped, so their contributions to the kept nodes vanish from the graph.

:func:`limit_features` makes the same choice on a graph whose rows are all computed, by replaying those rounds
(the rows are exact whatever order they are computed in, so the partial influences, and the features chosen, are
circuit-tracer's for the same adjacency and batch size). It saves no computation: :func:`~gradpatch.circuits.attribute`
computes every row first.
"""

from __future__ import annotations

import dataclasses

import torch

from .attribute import AttributionGraph
from .errors import CircuitError
from .prune import compute_influence, logit_weights, normalize_matrix

__all__ = ["limit_features", "visit_order"]


def visit_order(graph: AttributionGraph, max_feature_nodes: int, batch_size: int = 512,
                update_interval: int = 4) -> torch.Tensor:
    """The features circuit-tracer visits, in visiting order (module docstring): indices ``[min(N, n_features)]``.

    Args:
        graph: an unpruned graph with every row computed.
        max_feature_nodes: N.
        batch_size, update_interval: circuit-tracer's (the partial influences are recomputed after each
            ``update_interval · batch_size`` features; its defaults 512 and 4).

    Raises:
        CircuitError: ``max_feature_nodes``, ``batch_size`` or ``update_interval`` below 1.
    """
    for name, value in (("max_feature_nodes", max_feature_nodes), ("batch_size", batch_size),
                        ("update_interval", update_interval)):
        if value < 1:
            raise CircuitError(f"{name}={value}: give at least 1")
    total = graph.n_features
    limit = min(max_feature_nodes, total)
    if limit == total:
        return torch.arange(total)
    weights = logit_weights(graph)
    rows = torch.zeros(graph.adjacency.shape[0], dtype=torch.bool)
    rows[graph.logit_start:] = True
    order: list[torch.Tensor] = []
    visited = torch.zeros(total, dtype=torch.bool)
    while int(visited.sum()) < limit:
        known = torch.where(rows[:, None], graph.adjacency, torch.zeros(()))
        influence = compute_influence(normalize_matrix(known), weights)[:total]
        rank = torch.argsort(influence, descending=True)
        chosen = rank[~visited[rank]][:min(update_interval * batch_size, limit - int(visited.sum()))]
        visited[chosen] = True
        rows[chosen] = True
        order.append(chosen)
    return torch.cat(order)


def limit_features(graph: AttributionGraph, max_feature_nodes: int, batch_size: int = 512,
                   update_interval: int = 4) -> AttributionGraph:
    """``graph`` with only the features :func:`visit_order` chooses, in their original order (errors, tokens and
    logits kept): adjacency ``[n', n']`` with n' = min(N, n_features) + the other nodes.

    Raises:
        CircuitError: as :func:`visit_order`.
    """
    chosen = visit_order(graph, max_feature_nodes, batch_size, update_interval)
    if len(chosen) == graph.n_features:
        return graph
    features = torch.sort(chosen).values
    keep = torch.cat([features, torch.arange(graph.n_features, graph.adjacency.shape[0])])
    kept = keep.tolist()
    return dataclasses.replace(graph, active_features=graph.active_features[features],
                               activations=graph.activations[features],
                               adjacency=graph.adjacency[keep][:, keep].contiguous(),
                               nodes=[graph.nodes[i] for i in kept] if graph.nodes else [])
