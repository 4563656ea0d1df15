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

from ..errors import NodePathError
from ..patchable_graph import PatchableGraph
from .errors import AttributionError

__all__ = ["GPT2_FAMILY", "KINDS", "LLAMA_FAMILY", "QK_KINDS", "ModelFamily", "Node", "Unit", "as_nodes",
           "attention_nodes", "count_layers", "detect_family", "resolve_nodes", "units"]

#: The node kinds, in the order ``"all"`` expands to.
KINDS = ("resid", "heads", "mlp")
#: Per-head queries and keys ``[batch, heads, seq, head_dim]`` (AtP*'s QK fix recomputes their softmax exactly).
QK_KINDS = ("queries", "keys")


@dataclass(frozen=True)
class ModelFamily:
    """Where a model family keeps the attribution nodes of a transformer block (``{}`` is the layer index).

    Attributes:
        layer: NodePath pattern of a block, e.g. ``"model.layers_{}"``.
        resid: residual stream after the block ``[batch, seq, d_model]``, relative to ``layer``.
        heads: input of the attention output projection ``[batch, seq, n_heads * head_dim]``, relative to ``layer``.
        mlp: MLP output ``[batch, seq, d_model]``, relative to ``layer``.
        queries: the attention's queries ``[batch, heads, seq, head_dim]`` as scaled dot-product attention receives
            them (after rotary embeddings), relative to ``layer``.
        keys: the keys ``[batch, kv_heads, seq, head_dim]``, likewise.
        values: the values ``[batch, kv_heads, seq, head_dim]``, likewise.
        pattern_output: the attention's output before heads are merged ``[batch, heads, seq, head_dim]``.
        attn: the attention block's output as it is added to the residual stream ``[batch, seq, d_model]`` (GradDrop
            stops the gradient there), relative to ``layer``.
        embed: the token embeddings ``[batch, seq, d_model]`` (an upstream node of edges).
        logits_input: the unembedding's input; only its last position is kept (the metrics read the last
            position), so the vocabulary projection runs once per row.
    """

    layer: str
    resid: str
    heads: str
    mlp: str
    embed: str
    queries: str
    keys: str
    values: str
    pattern_output: str
    attn: str
    logits_input: str = "lm_head.input"

    def path(self, kind: str, layer: int) -> str:
        """The NodePath of ``kind`` (one of :data:`KINDS`) at block ``layer``."""
        return f"{self.layer.format(layer)}.{getattr(self, kind)}"


#: Llama, Mistral, Qwen2, SmolLM2.
LLAMA_FAMILY = ModelFamily(layer="model.layers_{}", resid="output", heads="self_attn.o_proj.input",
                           mlp="mlp.output", embed="model.embed_tokens.output", queries="self_attn.q_embed",
                           keys="self_attn.k_embed", values="self_attn.value_states",
                           pattern_output="self_attn.attn_output", attn="self_attn.output|sub_0")
#: GPT-2 (its ``Conv1D`` output projection names its input ``x``).
GPT2_FAMILY = ModelFamily(layer="transformer.h_{}", resid="output", heads="attn.c_proj.x", mlp="mlp.output",
                          embed="transformer.wte.output", queries="attn.query_states_1", keys="attn.key_states_1",
                          values="attn.value_states_1", pattern_output="attn.attn_output",
                          attn="attn.output|sub_0")


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


def _exists(pg: PatchableGraph, path: str) -> bool:
    try:
        pg.node(path)
    except NodePathError:
        return False
    return True


def detect_family(pg: PatchableGraph) -> ModelFamily:
    """The family (:data:`LLAMA_FAMILY`, :data:`GPT2_FAMILY`) whose block NodePaths exist in ``pg``.

    Raises:
        AttributionError: neither fits; pass NodePaths instead of kinds.
    """
    for family in (LLAMA_FAMILY, GPT2_FAMILY):
        if _exists(pg, family.path("resid", 0)):
            return family
    raise AttributionError("node kinds resid/heads/mlp need a Llama-style (model.layers_N) or GPT-2 (transformer.h_N) "
                           "graph; for this model pass NodePaths instead (print pg.graph to find them)")


def count_layers(pg: PatchableGraph, family: ModelFamily) -> int:
    """The number of blocks: the first ``i`` whose block NodePath does not exist."""
    n = 0
    while _exists(pg, family.layer.format(n)):
        n += 1
    return n


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
        path = f"{family.layer.format(layer)}.{getattr(family, part)}"
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
                found.extend(_node(pg, family.path(kind, layer), kind, layer, heads) for layer in range(n_layers))
        elif _exists(pg, name):
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
