"""Pruning an attribution graph by influence, and its replacement and completeness scores (Ameisen et al. 2025,
"Circuit Tracing", section 2.6 and appendix "Graph pruning"; circuit-tracer's ``graph.py``).

With A ``[n, n]`` the adjacency (rows = targets) and Â = |A| with each row normalised to sum 1, the influence of
every node on the logits, weighted by the logits' probabilities w ``[n]`` (zero off the logit nodes), is::

    influence = w Â + w Â² + … = w ((I − Â)⁻¹ − I)                                        (a row vector [n])

computed by repeated products until they vanish (Â is nilpotent: the graph is acyclic). A is held as its target rows
``[n_targets, n]`` (:class:`~gradpatch.circuits.graph.AttributionGraph`; the error and token rows are zero), and every
product and mask here runs on those rows alone: nothing is ``[n, n]``. Node pruning keeps the
nodes of highest influence that carry ``node_threshold`` of the total (default 0.8), plus every token and logit;
edge pruning scores each edge of the node-pruned graph by Â'[t, s] · (influence'[t] + w[t]) and keeps those that
carry ``edge_threshold`` of the total (default 0.98); then feature and error nodes without a kept outgoing edge, and
features without a kept incoming edge, are dropped until nothing changes.

Scores (circuit-tracer's ``compute_graph_scores``): with influence from the unpruned graph,

    replacement = Σ_tokens influence / (Σ_tokens influence + Σ_errors influence)
    completeness = Σ_t (1 − Σ_errors Â[t, ·]) (influence[t] + w[t]) / Σ_t (influence[t] + w[t])

the fraction of end-to-end influence that reaches the logits from tokens rather than from errors, and the fraction
of each node's direct inputs that is not error, weighted by its influence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import CircuitError
from .graph import AttributionGraph

__all__ = ["GraphInfluence", "PruneResult", "compute_influence", "graph_influence", "graph_scores", "logit_weights",
           "normalize_matrix", "prune_graph"]


@dataclass
class PruneResult:
    """Which nodes and edges survive pruning.

    Attributes:
        node_mask: ``[n]`` bool.
        edge_mask: ``[n_targets, n]`` bool, rows = the graph's target rows (:attr:`AttributionGraph.rows`, node
            indices :attr:`AttributionGraph.target_nodes`), columns = sources.
        cumulative_scores: ``[n]``, each node's cumulative share of influence in descending order of influence.
    """

    node_mask: torch.Tensor
    edge_mask: torch.Tensor
    cumulative_scores: torch.Tensor


@dataclass(frozen=True)
class GraphInfluence:
    """The unpruned graph's Â (its target rows, ``[n_targets, n]``), w ``[n]`` and influence ``[n]`` (module
    docstring), which pruning, the scores and reports all start from: computed once by :func:`graph_influence` and
    handed to each."""

    normalized: torch.Tensor
    weights: torch.Tensor
    influence: torch.Tensor


def normalize_matrix(matrix: torch.Tensor, inplace: bool = False) -> torch.Tensor:
    """|A| with each row divided by its sum (rows summing to 0 stay 0): ``[k, n]`` -> ``[k, n]``, one new tensor
    (``inplace``: ``matrix`` itself, overwritten)."""
    normalized = matrix.abs_() if inplace else matrix.abs()
    normalized /= normalized.sum(dim=1, keepdim=True).clamp(min=1e-10)
    return normalized


def compute_influence(normalized: torch.Tensor, weights: torch.Tensor, row_nodes: torch.Tensor | None = None,
                      max_iter: int = 1000) -> torch.Tensor:
    """w Â + w Â² + … ``[n]`` (module docstring), from the rows of Â that are held (circuit-tracer's
    ``compute_partial_influences``: the other rows are zero).

    Args:
        normalized: Â's rows ``[k, n]``; ``[n, n]`` when ``row_nodes`` is ``None``.
        weights: w ``[n]``.
        row_nodes: the node index of each row ``[k]``; ``None``: row i is node i.
        max_iter: the products allowed.

    Raises:
        CircuitError: the products have not vanished after ``max_iter`` steps (the graph has a cycle).
    """
    def step(vector: torch.Tensor) -> torch.Tensor:
        return (vector if row_nodes is None else vector[row_nodes]) @ normalized

    current = step(weights)
    influence = current.clone()
    for _ in range(max_iter):
        if not bool(current.any()):
            return influence
        current = step(current)
        influence += current
    raise CircuitError(f"influence did not converge in {max_iter} products: the adjacency has a cycle")


def logit_weights(graph: AttributionGraph) -> torch.Tensor:
    """w ``[n]``: each logit node's probability, 0 elsewhere."""
    weights = torch.zeros(graph.n_nodes)
    weights[graph.logit_start:] = graph.logit_probabilities.float()
    return weights


def graph_influence(graph: AttributionGraph) -> GraphInfluence:
    """Â, w and the influence of ``graph``'s unpruned adjacency (module docstring), from its target rows.

    Raises:
        CircuitError: as :func:`compute_influence`.
    """
    normalized, weights = normalize_matrix(graph.rows), logit_weights(graph)
    return GraphInfluence(normalized, weights, compute_influence(normalized, weights, graph.target_nodes))


def _threshold(scores: torch.Tensor, fraction: float) -> torch.Tensor:
    """The score above which the highest scores carry ``fraction`` of the total."""
    ordered = torch.sort(scores, descending=True).values
    cumulative = torch.cumsum(ordered, dim=0) / torch.sum(ordered)
    index = min(int(torch.searchsorted(cumulative, fraction)), len(cumulative) - 1)
    return ordered[index]


def prune_graph(graph: AttributionGraph, node_threshold: float = 0.8, edge_threshold: float = 0.98,
                unpruned: GraphInfluence | None = None) -> PruneResult:
    """The nodes and edges kept (module docstring; circuit-tracer's defaults), computed on the target rows
    ``[n_targets, n]`` (the other rows have no edges). ``unpruned``: ``graph``'s :func:`graph_influence`, if
    already computed.

    Raises:
        CircuitError: a threshold outside [0, 1].
    """
    for name, value in (("node_threshold", node_threshold), ("edge_threshold", edge_threshold)):
        if not 0.0 <= value <= 1.0:
            raise CircuitError(f"{name}={value}: give a fraction of influence between 0 and 1")
    unpruned = unpruned or graph_influence(graph)
    weights, influence, targets = unpruned.weights, unpruned.influence, graph.target_nodes
    node_mask = influence >= _threshold(influence, node_threshold)
    node_mask[graph.token_start:] = True
    pruned = graph.rows.clone()
    pruned[~node_mask[targets]] = 0
    pruned[:, ~node_mask] = 0
    normalized = normalize_matrix(pruned)
    del pruned
    normalized *= (compute_influence(normalized, weights, targets) + weights)[targets, None]
    edge_mask = normalized >= _threshold(normalized.flatten(), edge_threshold)  # the edges' scores
    del normalized
    inner, features = graph.token_start, graph.n_features
    previous = None
    while previous is None or not torch.equal(previous, node_mask):
        previous = node_mask.clone()
        edge_mask[~node_mask[targets]] = False
        edge_mask[:, ~node_mask] = False
        node_mask[:inner] &= edge_mask[:, :inner].any(0)
        node_mask[:features] &= edge_mask[:features].any(1)
    ordered, order = torch.sort(influence, descending=True)
    cumulative = torch.zeros_like(influence)
    cumulative[order] = torch.cumsum(ordered, dim=0) / torch.sum(ordered)
    return PruneResult(node_mask, edge_mask, cumulative)


def graph_scores(graph: AttributionGraph, unpruned: GraphInfluence | None = None) -> tuple[float, float]:
    """(replacement score, completeness score) of the unpruned graph (module docstring). ``unpruned``: ``graph``'s
    :func:`graph_influence`, if already computed."""
    unpruned = unpruned or graph_influence(graph)
    normalized, weights, influence = unpruned.normalized, unpruned.weights, unpruned.influence
    errors = slice(graph.error_start, graph.token_start)
    token_influence = influence[graph.token_start:graph.logit_start].sum()
    error_influence = influence[errors].sum()
    replacement = token_influence / (token_influence + error_influence)
    non_error = torch.ones(graph.n_nodes)  # the rows without edges (errors, tokens) have no error input
    non_error[graph.target_nodes] = 1 - normalized[:, errors].sum(dim=-1)
    output_influence = influence + weights
    completeness = (non_error * output_influence).sum() / output_influence.sum()
    return float(replacement), float(completeness)
