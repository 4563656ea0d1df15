"""Which nodes the local replacement model freezes, found from the op graph (not from a per-architecture table).

The replacement model is linear from features to features once every nonlinearity outside the transcoders is
frozen at its value on the prompt (Ameisen et al. 2025, "Circuit Tracing", section 2.2, "the local replacement
model"): the attention patterns A = softmax(q kᵀ/√d + mask) ``[batch, heads, seq, seq]`` and the normalisation
scales 1/√(mean(x²) + ε) ``[batch, seq, 1]``. The graph is searched for the ops that compute them:

- attention probabilities: a ``softmax`` whose value has four dimensions ``[batch, heads, query, key]``
  (transformers' eager attention, ``attn_implementation="eager"``); or a ``scaled_dot_product_attention`` call
  (transformers' default SDPA), which computes the pattern inside one op: its query and key arguments are frozen
  instead, which fixes A exactly (SDPA(q₀, k₀, v) = A(q₀, k₀) v is linear in v);
- normalisation scales: an ``rsqrt`` op (RMSNorm's 1/√(mean(x²) + ε), Llama-family models).

Freezing a node is a patch that replaces its value by the detached value recorded on the prompt (a stop-gradient
at that node): gradients then flow through v and through x · scale alone. A graph with none of the expected nodes
gets :class:`~gradpatch.circuits.errors.FrozenNodesNotFoundError` naming what was looked for (GPT-2's LayerNorm is
one ``layer_norm`` op whose scale is not a node: the error says so).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..patchable_graph import PatchableGraph
from .errors import FrozenNodesNotFoundError

__all__ = ["FrozenNodes", "find_frozen_nodes"]

_SOFTMAX = ("call_function:softmax", "call_method:softmax")
_RSQRT = ("call_function:rsqrt", "call_method:rsqrt")
_SDPA = "scaled_dot_product_attention"
_LAYER_NORM = "call_function:layer_norm"


@dataclass(frozen=True)
class FrozenNodes:
    """The NodePaths frozen on the prompt.

    Attributes:
        attention: softmax outputs ``[batch, heads, seq, seq]``, or the query and key arguments of SDPA calls.
        norms: RMSNorm scales (``rsqrt``) ``[batch, seq, 1]``.
    """

    attention: tuple[str, ...]
    norms: tuple[str, ...]

    @property
    def paths(self) -> tuple[str, ...]:
        """Every frozen NodePath, attention first."""
        return self.attention + self.norms


def _sdpa_arguments(pg: PatchableGraph, path: str) -> list[str]:
    """The NodePaths of the query and key arguments of the SDPA call at ``path`` (siblings in its graph)."""
    node = pg.node(path)
    fx_nodes = {fx.name: fx for fx in node._gp_owner.graph.nodes}
    call = fx_nodes[node._gp_key]
    parent = path.rsplit(".", 1)[0] if "." in path else ""
    arguments = [call.kwargs.get(name, call.args[i] if len(call.args) > i else None)
                 for i, name in enumerate(("query", "key"))]
    paths = []
    for argument in arguments:
        name = getattr(argument, "name", None)
        sibling = f"{parent}.{name}" if parent else str(name)
        if name is None or sibling not in set(pg.node_paths()):
            raise FrozenNodesNotFoundError(f"the scaled_dot_product_attention call at '{path}' takes a query or key "
                                           f"that is not a node of the graph ({argument!r}); run the model with "
                                           f"attn_implementation='eager' so that the softmax is a node")
        paths.append(sibling)
    return paths


def find_frozen_nodes(pg: PatchableGraph) -> FrozenNodes:
    """The attention and normalisation nodes of ``pg`` to freeze (module docstring).

    Raises:
        FrozenNodesNotFoundError: no attention-probability node (softmax ``[batch, heads, q, k]`` or SDPA call) or no
            normalisation scale (``rsqrt``); the message names what was looked for and what was found instead.
    """
    attention: list[str] = []
    norms: list[str] = []
    layer_norms = 0
    for path in pg.node_paths():
        if "|" in path:
            continue
        node = pg.node(path)
        op = node._gp_op
        shape = node.tensor_shape
        if op in _SOFTMAX and shape is not None and len(shape) == 4:
            attention.append(path)
        elif op.endswith(_SDPA):
            attention.extend(_sdpa_arguments(pg, path))
        elif op in _RSQRT:
            norms.append(path)
        elif op == _LAYER_NORM:
            layer_norms += 1
    missing = []
    if not attention:
        missing.append("attention probabilities (a softmax with value [batch, heads, query, key], or a "
                       "scaled_dot_product_attention call)")
    if not norms:
        found = f"; found {layer_norms} layer_norm op(s), whose scale is inside one op and not yet frozen" \
            if layer_norms else ""
        missing.append(f"normalisation scales (an rsqrt op, as RMSNorm computes){found}")
    if missing:
        raise FrozenNodesNotFoundError(f"the local replacement model freezes {' and '.join(missing)}, but the graph "
                                       f"has none; print pg.graph to see its ops")
    return FrozenNodes(tuple(attention), tuple(norms))
