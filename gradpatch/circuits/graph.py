"""The attribution graph as data: :class:`AttributionGraph`, the nodes and edges that
:func:`~gradpatch.circuits.attribute.attribute` builds and the completeness check, pruning and files read.

Only the targets' rows are held: features and logits have incoming edges, errors and tokens none (their rows of the
adjacency are zero), so the adjacency ``[n, n]`` is stored as ``rows`` ``[n_features + n_logits, n]``, the rows of
the feature nodes then of the logit nodes (:attr:`AttributionGraph.target_nodes` gives their node indices), columns =
every node. With n ≈ L·seq error nodes on a long prompt this is what keeps a graph's memory linear in the prompt's
length (circuit-tracer's ``Graph`` holds the dense ``[n, n]``; its attribution fills only these rows).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["AttributionGraph"]


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
        rows: the targets' rows of the adjacency ``[n_features + n_logits, n]`` (float32; rows = the feature nodes
            then the logit nodes, columns = every node; module docstring), n = n_features + len(layers)·seq + seq +
            n_logits.
        nodes: NodePath of each node (a feature's and error's: the MLP output it writes; a token's: the
            embeddings; a logit's: the logits).
        zero_first_position: position 0's activations and errors were taken as 0 (module docstring of
            :mod:`gradpatch.circuits.attribute`).
        total_features: the active features the graph was chosen from (``max_feature_nodes``: the graph keeps
            ``n_features`` of them); ``None``: ``n_features``, every active feature.
    """

    input_tokens: torch.Tensor
    layers: list[int]
    active_features: torch.Tensor
    activations: torch.Tensor
    logit_tokens: torch.Tensor
    logit_probabilities: torch.Tensor
    rows: torch.Tensor
    nodes: list[str] = field(default_factory=list)
    zero_first_position: bool = False
    total_features: int | None = None

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

    @property
    def n_nodes(self) -> int:
        """n, from the nodes' counts (not from ``rows``' shape)."""
        return self.logit_start + int(self.logit_tokens.shape[0])

    @property
    def target_nodes(self) -> torch.Tensor:
        """The node index of each of ``rows``' rows ``[n_features + n_logits]``: the features, then the logits."""
        return torch.cat([torch.arange(self.n_features), torch.arange(self.logit_start, self.n_nodes)])

    @property
    def adjacency(self) -> torch.Tensor:
        """The dense adjacency ``[n, n]`` (rows = targets, the error and token rows zero): a new tensor of n² floats,
        for small graphs and tests; code that must scale reads :attr:`rows`."""
        dense = torch.zeros(self.n_nodes, self.n_nodes, dtype=self.rows.dtype)
        dense[self.target_nodes] = self.rows
        return dense
