"""The attribution graph as data: :class:`AttributionGraph`, the nodes and edges that
:func:`~gradpatch.circuits.attribute.attribute` builds and the completeness check, pruning and files read."""

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
        adjacency: ``[n, n]``, rows = targets, columns = sources, n = n_features + len(layers)·seq + seq + n_logits.
        nodes: NodePath of each node (a feature's and error's: the MLP output it writes; a token's: the
            embeddings; a logit's: the logits).
        zero_first_position: position 0's activations and errors were taken as 0 (module docstring).
    """

    input_tokens: torch.Tensor
    layers: list[int]
    active_features: torch.Tensor
    activations: torch.Tensor
    logit_tokens: torch.Tensor
    logit_probabilities: torch.Tensor
    adjacency: torch.Tensor
    nodes: list[str] = field(default_factory=list)
    zero_first_position: bool = False

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
