"""Which activations attribution scores: node kinds of Llama-style and GPT-2 models, or any NodePaths.

A :class:`Node` is one NodePath whose value is ``[batch, seq, width]``; for attention heads the width splits into
``[n_heads, head_dim]`` (the input of the output projection, ``o_proj`` / ``c_proj``, is the concatenation of the
heads' outputs ``z``), so one unit is (node, position[, head]). The attention's queries and keys (after rotary
embeddings) are ``[batch, heads, seq, head_dim]`` values; :meth:`Node.flat` shows them as ``[batch, seq, width]`` too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..errors import LayoutError, NodePathError
from ..layouts import GPT2_LAYOUT, LLAMA_LAYOUT, ModelLayout, count_layers, detect_layout, has_node
from ..patchable_graph import PatchableGraph
from .errors import AttributionError, AttributionLayoutError

__all__ = ["GPT2_FAMILY", "KINDS", "LLAMA_FAMILY", "QK_KINDS", "ModelFamily", "Node", "Unit", "as_nodes",
           "attention_nodes", "count_layers", "detect_family", "resolve_nodes", "units"]

#: The node kinds, in the order ``"all"`` expands to.
KINDS = ("resid", "heads", "mlp")
#: Per-head queries and keys ``[batch, heads, seq, head_dim]`` (AtP*'s QK fix recomputes their softmax exactly).
QK_KINDS = ("queries", "keys")


#: Where a model family keeps the attribution nodes of a block: the one layout table's
#: :class:`~gradpatch.layouts.ModelLayout` (``path("resid", layer)``, ``path("heads", layer)``, ``path("mlp", layer)``).
ModelFamily = ModelLayout
#: Llama, Mistral, Qwen2, SmolLM2.
LLAMA_FAMILY = LLAMA_LAYOUT
#: GPT-2 (its ``Conv1D`` output projection names its input ``x``).
GPT2_FAMILY = GPT2_LAYOUT


@dataclass(frozen=True)
class Node:
    """One activation ``[batch, seq, width]`` that attribution patches.

    Attributes:
        path: its NodePath.
        kind: ``"resid"``, ``"heads"``, ``"mlp"``, ``"queries"``, ``"keys"`` or ``"node"`` (a NodePath given
            directly).
        layer: the block index, ``None`` for a NodePath given directly.
        n_heads: for heads, queries and keys, the number of heads the width splits into; ``None`` otherwise.
        width: the width of one position (``n_heads * head_dim`` for queries and keys).
        heads_first: the value is ``[batch, heads, seq, head_dim]`` (queries, keys) instead of ``[batch, seq, width]``.
    """

    path: str
    kind: str
    layer: int | None
    n_heads: int | None
    width: int
    heads_first: bool = False

    def flat(self, value: torch.Tensor) -> torch.Tensor:
        """``value`` as ``[batch, seq, width]`` (heads-first values transposed and merged)."""
        if not self.heads_first:
            return value
        batch, heads, seq, head_dim = value.shape
        return value.transpose(1, 2).reshape(batch, seq, heads * head_dim)

    def unflat(self, flat: torch.Tensor) -> torch.Tensor:
        """The inverse of :meth:`flat`: ``[batch, seq, width]`` back to the node's own layout."""
        if not self.heads_first:
            return flat
        batch, seq, _ = flat.shape
        return flat.reshape(batch, seq, self.n_heads or 1, self.head_dim).transpose(1, 2)

    @property
    def head_dim(self) -> int:
        """The width of one head (the whole width when the node has no heads)."""
        return self.width // self.n_heads if self.n_heads else self.width


@dataclass(frozen=True)
class Unit:
    """What one patch replaces: ``node``'s value at ``position`` (0-based in the prompt), for heads one ``head``."""

    node: Node
    position: int
    head: int | None

    def features(self) -> slice:
        """The slice of the last dimension this unit covers."""
        if self.head is None:
            return slice(None)
        return slice(self.head * self.node.head_dim, (self.head + 1) * self.node.head_dim)


def detect_family(pg: PatchableGraph) -> ModelFamily:
    """The known layout (:data:`LLAMA_FAMILY`, :data:`GPT2_FAMILY`) whose NodePaths exist in ``pg``.

    Raises:
        AttributionLayoutError: none fits (the message names the NodePaths looked for); pass NodePaths instead of
            kinds.
    """
    try:
        return detect_layout(pg)
    except LayoutError as error:
        raise AttributionLayoutError(f"node kinds {', '.join((*KINDS, *QK_KINDS))} need a known model layout: "
                                     f"{error}; or pass NodePaths instead of kinds") from None


def _n_heads(pg: PatchableGraph) -> int:
    config = pg.config
    n = getattr(config, "num_attention_heads", None) or getattr(config, "n_head", None)
    if not n:
        raise AttributionError("the model config names no num_attention_heads (or n_head): the 'heads' kind needs it; "
                               "pass the o_proj input NodePath as a node instead")
    return int(n)


def attention_nodes(pg: PatchableGraph, family: ModelFamily, layer: int) -> dict[str, Node]:
    """The queries, keys, values and pattern output of block ``layer``'s attention as heads-first nodes.

    Raises:
        AttributionError: one of them is not a ``[batch, heads, seq, head_dim]`` node of the graph.
    """
    found = {}
    for part in ("queries", "keys", "values", "pattern_output"):
        try:
            path = family.path(part, layer)
        except LayoutError as error:
            raise AttributionLayoutError(f"the QK fix: {error}") from None
        node = _node(pg, path, "queries", layer, None)
        if not node.heads_first:
            raise AttributionError(f"{path!r} is not a [batch, heads, seq, head_dim] value: the QK fix needs the "
                                   f"attention's queries, keys and values as scaled dot-product attention receives "
                                   f"them")
        found[part] = Node(path=path, kind=part, layer=layer, n_heads=node.n_heads, width=node.width, heads_first=True)
    return found


def _node(pg: PatchableGraph, path: str, kind: str, layer: int | None, n_heads: int | None) -> Node:
    try:
        data = pg.node(path)
    except NodePathError as error:
        raise AttributionError(f"unknown node {path!r}: {error}") from error
    shape = data.tensor_shape
    if kind in QK_KINDS and shape is not None and len(shape) == 4:
        return Node(path=path, kind=kind, layer=layer, n_heads=int(shape[1]), width=int(shape[1] * shape[3]),
                    heads_first=True)
    if shape is None or len(shape) != 3:
        raise AttributionError(f"node {path!r} is not a [batch, seq, width] tensor (shape {data._shape}); give a "
                               f"NodePath of one (dig into a tuple with '|sub_0')")
    if n_heads and shape[-1] % n_heads:
        raise AttributionError(f"node {path!r} has width {shape[-1]}, not a multiple of {n_heads} heads")
    return Node(path=path, kind=kind, layer=layer, n_heads=n_heads, width=int(shape[-1]))


def resolve_nodes(pg: PatchableGraph, nodes: str | Sequence[str]) -> list[Node]:
    """The nodes that ``nodes`` names: a kind (``"resid"``, ``"heads"``, ``"mlp"``, ``"queries"``, ``"keys"``),
    ``"all"`` (resid, heads and mlp), or a sequence of kinds and NodePaths (each a ``[batch, seq, width]`` tensor).

    Raises:
        AttributionError: an unknown kind or NodePath (naming the kinds and the closest NodePaths), a node that is not
            ``[batch, seq, width]``, an empty selection.
    """
    names = [nodes] if isinstance(nodes, str) else list(nodes)
    if not names:
        raise AttributionError(f"no nodes: give a kind ({', '.join(KINDS)}, all) or NodePaths")
    found: list[Node] = []
    for name in names:
        if name in (*KINDS, *QK_KINDS, "all"):
            family = detect_family(pg)
            n_layers = count_layers(pg, family)
            for kind in KINDS if name == "all" else (name,):
                heads = _n_heads(pg) if kind == "heads" else None
                try:
                    paths = [family.path(kind, layer) for layer in range(n_layers)]
                except LayoutError as error:
                    raise AttributionLayoutError(f"node kind {kind!r}: {error}") from None
                found.extend(_node(pg, path, kind, layer, heads) for layer, path in enumerate(paths))
        elif has_node(pg, name):
            found.append(_node(pg, name, "node", None, None))
        else:
            try:
                pg.node(name)
            except NodePathError as error:
                raise AttributionError(f"unknown node kind or NodePath {name!r}: give one of "
                                       f"{', '.join((*KINDS, *QK_KINDS))}, all, "
                                       f"or a NodePath ({error})") from error
    unique: dict[str, Node] = {}
    for node in found:
        unique.setdefault(node.path, node)
    return list(unique.values())


def units(nodes: Sequence[Node], positions: Sequence[int]) -> list[Unit]:
    """Every (node, position[, head]) of ``nodes`` at ``positions``, node by node, then position, then head."""
    return [Unit(node, position, head) for node in nodes for position in positions
            for head in (range(node.n_heads) if node.n_heads else (None,))]


def as_nodes(pg: PatchableGraph, nodes: str | Sequence[str] | Sequence[Node]) -> list[Node]:
    """``nodes`` resolved by :func:`resolve_nodes`, or as they are when they are already :class:`Node`\\ s.

    Raises:
        AttributionError: as :func:`resolve_nodes`.
    """
    if not isinstance(nodes, str) and nodes and all(isinstance(node, Node) for node in nodes):
        return list(nodes)  # type: ignore[arg-type]
    return resolve_nodes(pg, nodes)  # type: ignore[arg-type]
