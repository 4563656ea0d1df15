"""The attention layers of a graph, found from its ops: where each layer's queries, keys, per-head output and score
scale are, for QK attributions (:mod:`gradpatch.circuits.qk`) and head loadings (:mod:`gradpatch.circuits.heads`).

An attention layer is one of the two forms :mod:`gradpatch.circuits.freeze` freezes (the graph's nodes are in the
order they run, so the i-th one found is block i's):

- a ``scaled_dot_product_attention`` call (transformers' SDPA): its ``query`` and ``key`` arguments
  ``[batch, heads, seq, head_dim]`` / ``[batch, kv_heads, seq, head_dim]`` (after QK-norms and rotary embeddings,
  as the product receives them), its ``scale`` (1/√head_dim when absent), its ``attn_mask`` node (added to the
  scores, or a boolean keep-mask) and ``is_causal``; its value is the per-head output ``[batch, heads, seq,
  head_dim]``;
- a ``softmax`` of value ``[batch, heads, query, key]`` (eager attention): its input is walked back through
  multiplications and divisions by numbers (the scale), additions of another node (the causal or sliding-window mask,
  ALiBi: constants of the frozen model) and dtype casts to a ``matmul(query, key.transpose(...))``; the per-head
  output is the ``matmul`` of the pattern (after casts and dropout) and the values.

Any other op between the scores and the softmax (Gemma 2's attention-logit soft-capping ``tanh``) is not bilinear in
the query and the key, and :class:`AttentionFitError` says so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..patchable_graph import PatchableGraph
from .errors import AttentionFitError
from .freeze import argument_path, call_argument

__all__ = ["AttentionFitError", "AttentionSite", "find_attention_sites"]

_SDPA = "scaled_dot_product_attention"
_SOFTMAX = ("call_function:softmax", "call_method:softmax")
#: Ops between the scores and the softmax, or the pattern and the values, that do not change a value.
_CASTS = frozenset({"to", "float", "type", "contiguous", "dropout", "clone"})


@dataclass(frozen=True)
class AttentionSite:
    """One attention layer, found from the graph's ops.

    Attributes:
        layer: its index among the graph's attention layers (block index).
        query: NodePath of the queries ``[batch, heads, seq, head_dim]`` as the score product reads them (``None``
            for a score that is not bilinear, found with ``bilinear=False``).
        key: NodePath of the keys ``[batch, kv_heads, seq, head_dim]`` (kv_heads divides heads; GQA), or ``None``.
        output: NodePath of the per-head output A·V ``[batch, heads, seq, head_dim]``.
        scale: the score's factor: s = scale · q · k + mask.
        mask: NodePath of a mask added to the scores (broadcast to ``[batch, heads, query, key]``; a boolean one
            keeps where True), or ``None``.
        causal: the op masks keys after the query itself (SDPA's ``is_causal``).
        frozen: the NodePaths the replacement model freezes for this layer (SDPA: query and key; eager: the
            softmax), from :func:`~gradpatch.circuits.freeze.find_frozen_nodes`.
    """

    layer: int
    query: str | None
    key: str | None
    output: str
    scale: float
    mask: str | None
    causal: bool
    frozen: tuple[str, ...]


def _op_name(fx: Any) -> str:
    return fx.target if isinstance(fx.target, str) else getattr(fx.target, "__name__", str(fx.target))


def _sdpa_site(pg: PatchableGraph, layer: int, path: str) -> AttentionSite:
    call = pg.node(path).fx_node
    query, key = call_argument(call, 0, "query"), call_argument(call, 1, "key")
    mask, scale = call_argument(call, 3, "attn_mask"), call_argument(call, 6, "scale")
    causal = bool(call_argument(call, 5, "is_causal"))
    query_path, key_path = argument_path(pg, path, query), argument_path(pg, path, key)
    if scale is None:
        scale = 1.0 / math.sqrt(pg.node(query_path).tensor_shape[-1])
    elif hasattr(scale, "op"):
        raise AttentionFitError(f"the attention at '{path}' takes a scale computed in the graph ({scale!r}); a "
                                f"QK attribution needs a number")
    mask_path = argument_path(pg, path, mask) if hasattr(mask, "op") else None
    return AttentionSite(layer, query_path, key_path, path, float(scale), mask_path, causal, (query_path, key_path))


def _eager_site(pg: PatchableGraph, layer: int, path: str, bilinear: bool) -> AttentionSite:
    """Walk back from the softmax at ``path`` to ``matmul(q, kᵀ)`` and forward to ``matmul(pattern, v)``; without
    ``bilinear``, a score that is not bilinear gives a site without query and key instead of an error."""
    try:
        query, key, scale, mask = _eager_score(pg, path)
    except AttentionFitError:
        if bilinear:
            raise
        return AttentionSite(layer, None, None, _pattern_output(pg, path), math.nan, None, False, (path,))
    return AttentionSite(layer, query, key, _pattern_output(pg, path), scale, mask, False, (path,))


def _eager_score(pg: PatchableGraph, path: str) -> tuple[str, str, float, str | None]:
    """(query, key, scale, mask) of the eager softmax at ``path`` (its input walked back to ``matmul(q, kᵀ)``)."""
    fx = pg.node(path).fx_node.args[0]
    scale, mask = 1.0, None
    while not (fx.op == "call_function" and _op_name(fx) == "matmul"):
        name = _op_name(fx)
        numbers = [a for a in fx.args[1:] if isinstance(a, (int, float))]
        tensors = [a for a in fx.args if hasattr(a, "op")]
        if name in _CASTS:
            fx = fx.args[0]
        elif name in ("mul", "truediv", "div") and len(tensors) == 1 and numbers:
            scale = scale * numbers[0] if name == "mul" else scale / numbers[0]
            fx = tensors[0]
        elif name in ("add", "iadd") and len(tensors) == 2 and mask is None:
            # the scores are the operand whose shape has the heads (the mask broadcasts over them)
            shapes = [pg.node(argument_path(pg, path, t)).tensor_shape for t in tensors]
            scores = 0 if shapes[0] is not None and len(shapes[0]) == 4 and shapes[0][1] > 1 else 1
            mask = argument_path(pg, path, tensors[1 - scores])
            fx = tensors[scores]
        else:
            raise AttentionFitError(f"between the scores and the softmax at '{path}' runs '{name}' ({fx.name}), "
                                    f"which is not a scale, a cast or an added mask: the score is not bilinear in "
                                    f"the query and the key (e.g. attention-logit soft-capping); QK attributions "
                                    f"need q · k · scale + a constant")
    query, transposed = fx.args[0], fx.args[1]
    if _op_name(transposed) not in ("transpose", "mT"):
        raise AttentionFitError(f"the score product '{fx.name}' before the softmax at '{path}' does not take the "
                                f"keys transposed ({transposed!r}); QK attributions need matmul(q, k.transpose)")
    key = transposed.args[0] if hasattr(transposed.args[0], "op") else transposed
    return argument_path(pg, path, query), argument_path(pg, path, key), scale, mask


def _pattern_output(pg: PatchableGraph, path: str) -> str:
    """The NodePath of the ``matmul`` that applies the softmax at ``path`` to the values (through casts)."""
    frontier = [pg.node(path).fx_node]
    while frontier:
        fx = frontier.pop()
        for user in fx.users:
            name = _op_name(user)
            if name == "matmul" and user.args[0] is fx:
                return argument_path(pg, path, user)
            if name in _CASTS:
                frontier.append(user)
    raise AttentionFitError(f"no matmul(pattern, values) follows the softmax at '{path}'; head loadings need the "
                            f"per-head output [batch, heads, seq, head_dim]")


def find_attention_sites(pg: PatchableGraph, bilinear: bool = True) -> list[AttentionSite]:
    """Every attention layer of ``pg``, in the order they run (module docstring).

    Args:
        pg: the graph.
        bilinear: refuse a layer whose score is not q · k · scale plus a constant (QK attributions need it); with
            ``False`` such a layer is a site without query and key (head loadings need only the per-head output).

    Raises:
        AttentionFitError: no attention layer, or (with ``bilinear``) one whose score is not q · k · scale plus a
            constant (the message names the op).
    """
    sites: list[AttentionSite] = []
    for path in pg.node_paths():
        if "|" in path:
            continue
        node = pg.node(path)
        shape = node.tensor_shape
        if node.op_name.endswith(_SDPA):
            sites.append(_sdpa_site(pg, len(sites), path))
        elif node.op_name in _SOFTMAX and shape is not None and len(shape) == 4:
            sites.append(_eager_site(pg, len(sites), path, bilinear))
    if not sites:
        raise AttentionFitError("the graph has no attention layer (a scaled_dot_product_attention call or a softmax "
                                "with value [batch, heads, query, key]); print pg.graph to see its ops")
    return sites
