"""Which nodes the local replacement model freezes, found from the op graph (not from a per-architecture table).

The replacement model is linear from features to features once every nonlinearity outside the transcoders is
frozen at its value on the prompt (Ameisen et al. 2025, "Circuit Tracing", section 2.2, "the local replacement
model"): the attention patterns A = softmax(q kᵀ/√d + mask) ``[batch, heads, seq, seq]`` and the normalisation
scales 1/√(mean(x²) + ε) ``[batch, seq, 1]``. The graph is searched for the ops that compute them:

- attention probabilities: a ``softmax`` whose value has four dimensions ``[batch, heads, query, key]``
  (transformers' eager attention, ``attn_implementation="eager"``); or a ``scaled_dot_product_attention`` call
  (transformers' default SDPA), which computes the pattern inside one op: its query and key arguments are frozen
  instead, which fixes A exactly (SDPA(q₀, k₀, v) = A(q₀, k₀) v is linear in v);
- normalisation scales: an ``rsqrt`` op (RMSNorm's 1/√(mean(x²) + ε), Llama-family models), or a ``layer_norm``
  op (GPT-2), which computes its scale inside one op: its output is replaced by the affine function of its input
  that the frozen scale gives, y⁰ + ((x − x̄) − (x⁰ − x̄⁰)) / σ⁰ · w (:class:`FrozenLayerNorm`; ⁰ = on the prompt);
- elementwise nonlinearities after the last of those nodes, on the way to the logits: an op y = f(z) of one tensor
  whose name is one of :data:`ELEMENTWISE` (Gemma 2's final logit soft-capping, cap · tanh(z / cap)) is linearised
  at the prompt, y⁰ + f′(z⁰) ⊙ (z − z⁰) (:class:`LinearisedOp`): its slope f′(z⁰) is a per-element scale frozen
  like the norm scales (for the soft-capping, 1 − tanh²(z⁰/cap) per logit). Nonlinearities before the last frozen
  node need no rule: Gemma 2's attention-logit soft-capping comes before its softmax, inside the frozen pattern, and
  the MLPs' activations are replaced by the transcoders. Linear ops (Cohere's ``logit_scale`` product, Granite's
  division by ``logits_scaling``) stay as they are.

An SDPA call whose query and key are frozen is also a :class:`FrozenPattern`: its pattern A⁰ ``[1, heads, query,
key]`` is recorded (SDPA of q⁰, k⁰ and an identity value, with the call's own mask, scale and causality), so that
the replacement model's backward passes go through A⁰ᵀ g alone instead of SDPA's backward, which also computes the
query's and key's gradients that the frozen pattern discards (about a quarter of a backward pass on SmolLM2 at 16
tokens). A call with a mask that is not a node of the graph, or with dropout, has none (its SDPA backward stays).

Freezing a node is a patch that replaces its value by the detached value recorded on the prompt (a stop-gradient
at that node): gradients then flow through v and through x · scale alone. A graph with none of the expected nodes
gets :class:`~gradpatch.circuits.errors.FrozenNodesNotFoundError` naming what was looked for. A nonlinearity that no
rule here covers leaves the graph incomplete, which :func:`~gradpatch.circuits.complete.check_completeness` refuses.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..patchable_graph import PatchableGraph
from .errors import FrozenNodesNotFoundError

__all__ = ["ELEMENTWISE", "FrozenLayerNorm", "FrozenNodes", "FrozenPattern", "LinearisedOp", "find_frozen_nodes"]

_SOFTMAX = ("call_function:softmax", "call_method:softmax")
_RSQRT = ("call_function:rsqrt", "call_method:rsqrt")
_SDPA = "scaled_dot_product_attention"
_LAYER_NORM = "call_function:layer_norm"
#: Names of the elementwise nonlinear ops linearised after the last frozen node (``torch.<name>``, ``Tensor.<name>``
#: or ``torch.nn.functional.<name>``).
ELEMENTWISE = frozenset({"tanh", "sigmoid", "exp", "log", "softplus", "gelu", "silu", "relu", "erf", "sqrt", "pow"})
_ELEMENTWISE_OPS = frozenset(f"{kind}:{name}" for kind in ("call_function", "call_method") for name in ELEMENTWISE)


@dataclass(frozen=True)
class FrozenLayerNorm:
    """A ``layer_norm`` op whose scale σ is frozen (module docstring).

    Attributes:
        input: the NodePath of its input x ``[..., *normalized_shape]``.
        output: the NodePath of the op ``[..., *normalized_shape]``.
        weight: w ``normalized_shape`` (``None`` without one).
        dims: the normalised dimensions (negative).
        eps: ε of σ = √(var(x) + ε).
    """

    input: str
    output: str
    weight: torch.Tensor | None
    dims: tuple[int, ...]
    eps: float

    def scale(self, x: torch.Tensor) -> torch.Tensor:
        """σ = √(var(x) + ε) over :attr:`dims` (kept as size-1 dimensions)."""
        return (x.var(dim=self.dims, unbiased=False, keepdim=True) + self.eps).sqrt()

    def frozen(self, x: torch.Tensor, x0: torch.Tensor, y0: torch.Tensor, sigma0: torch.Tensor) -> torch.Tensor:
        """y⁰ + ((x − x̄) − (x⁰ − x̄⁰)) / σ⁰ · w: affine in x, equal to y⁰ at x = x⁰."""
        difference = x - x0
        centred = (difference - difference.mean(dim=self.dims, keepdim=True)) / sigma0
        return y0 + (centred if self.weight is None else centred * self.weight.detach())


@dataclass(frozen=True)
class LinearisedOp:
    """An elementwise op y = f(z) linearised at the prompt (module docstring).

    Attributes:
        input: the NodePath of z (the op's first argument) ``[batch, seq, ...]``.
        output: the NodePath of the op, y ``[batch, seq, ...]``, the same shape.
        function: f, the op with its other (constant) arguments bound.
    """

    input: str
    output: str
    function: Callable[[torch.Tensor], torch.Tensor]

    def slope(self, z0: torch.Tensor) -> torch.Tensor:
        """f′(z⁰), the same shape as z⁰ (f is elementwise, so the gradient of Σ f(z) at z⁰ is its derivative)."""
        with torch.enable_grad():
            z = z0.detach().requires_grad_()
            (slope,) = torch.autograd.grad(self.function(z).sum(), z)
        return slope

    @staticmethod
    def linearised(z: torch.Tensor, z0: torch.Tensor, y0: torch.Tensor, slope: torch.Tensor) -> torch.Tensor:
        """y⁰ + f′(z⁰) ⊙ (z − z⁰): affine in z, equal to y⁰ at z = z⁰."""
        return y0 + slope * (z - z0)


@dataclass(frozen=True)
class FrozenPattern:
    """A ``scaled_dot_product_attention`` call whose pattern A⁰ = softmax(q⁰ k⁰ᵀ · scale + mask) is frozen (module
    docstring): its output SDPA(q⁰, k⁰, v) = A⁰ v is linear in v.

    Attributes:
        output: the NodePath of the call, ``[batch, heads, query, head_dim]``.
        query, key, value: the NodePaths of its arguments (``[batch, heads or kv_heads, seq, head_dim]``).
        mask: the NodePath of its ``attn_mask`` argument, or ``None`` where the call passes none.
        options: its other arguments: ``is_causal``, ``scale`` and ``enable_gqa`` where given.
    """

    output: str
    query: str
    key: str
    value: str
    mask: str | None
    options: tuple[tuple[str, Any], ...]

    def pattern(self, query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """A⁰ ``[batch, heads, query, key]`` from the recorded arguments: the call on an identity value (row i of
        A⁰ v is Σ_j A⁰_ij v_j, so with v = I it is A⁰'s row i), the same kernel and arguments as the model's."""
        batch, kv_heads, length = key.shape[0], key.shape[1], key.shape[2]
        identity = torch.eye(length, dtype=query.dtype, device=query.device).expand(batch, kv_heads, length, length)
        return torch.nn.functional.scaled_dot_product_attention(query, key, identity, attn_mask=mask,
                                                                **dict(self.options))

    @staticmethod
    def mixed(pattern: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """A⁰ v ``[batch, heads, query, head_dim]`` for the pattern ``[1, heads, query, key]`` and ``value``
        ``[batch, kv_heads, key, head_dim]``; with fewer kv heads than heads, head h reads kv head
        h // (heads / kv_heads) (SDPA's ``enable_gqa``). One product per kv head with the rows and head dimensions
        side by side, so that the pattern is neither copied per row nor repeated per head (autograd keeps it once,
        ``[heads, query, key]``, for every row's backward pass)."""
        _, heads, queries, keys = pattern.shape
        batch, kv_heads, _, width = value.shape
        grouped = pattern[0].reshape(kv_heads, heads // kv_heads * queries, keys)
        columns = value.permute(1, 2, 0, 3).reshape(kv_heads, keys, batch * width)
        return torch.bmm(grouped, columns).reshape(heads, queries, batch, width).permute(2, 0, 1, 3)


@dataclass(frozen=True)
class FrozenNodes:
    """The nodes frozen on the prompt.

    Attributes:
        attention: softmax outputs ``[batch, heads, seq, seq]``, or the query and key arguments of SDPA calls.
        norms: RMSNorm scales (``rsqrt``) ``[batch, seq, 1]``.
        layer_norms: ``layer_norm`` ops with their scale frozen.
        linearised: elementwise nonlinearities after the last frozen node, linearised at the prompt.
        patterns: the SDPA calls among ``attention`` whose pattern is frozen as a whole (:class:`FrozenPattern`).
    """

    attention: tuple[str, ...]
    norms: tuple[str, ...]
    layer_norms: tuple[FrozenLayerNorm, ...] = ()
    linearised: tuple[LinearisedOp, ...] = ()
    patterns: tuple[FrozenPattern, ...] = ()

    @property
    def paths(self) -> tuple[str, ...]:
        """Every frozen NodePath, attention first."""
        return self.attention + self.norms


def argument_path(pg: PatchableGraph, path: str, argument: Any) -> str:
    """The NodePath of ``argument`` (a torch.fx node) of the op at ``path``: a sibling whose key is the argument's
    name (or, for a placeholder, its target).

    Raises:
        FrozenNodesNotFoundError: the argument is not a node of the graph.
    """
    parent = path.rsplit(".", 1)[0] if "." in path else ""
    names = {getattr(argument, "name", None)}
    if getattr(argument, "op", "") == "placeholder":
        names.add(argument.target)
    for child in pg.node(parent) if parent else pg.graph:
        if "|" not in child._path and child.fx_name in names:
            return child._path
    raise FrozenNodesNotFoundError(f"the op at '{path}' takes {argument!r}, which is not a node of the graph; run the "
                                   f"model with attn_implementation='eager' (attention) or freeze it by hand")


def call_argument(call: Any, index: int, name: str) -> Any:
    """The argument ``name`` of the torch.fx node ``call``: its keyword, else its ``index``-th positional argument;
    ``None`` when it has neither."""
    return call.kwargs.get(name, call.args[index] if len(call.args) > index else None)


def _layer_norm(pg: PatchableGraph, path: str) -> FrozenLayerNorm:
    """The :class:`FrozenLayerNorm` of the ``layer_norm`` op at ``path`` (its input, weight and ε read from the
    op's arguments).

    Raises:
        FrozenNodesNotFoundError: its input is not a node, or its weight is not a parameter.
    """
    call = pg.node(path).fx_node
    shape = call_argument(call, 1, "normalized_shape")
    weight = call_argument(call, 2, "weight")
    eps = call_argument(call, 4, "eps")
    if weight is not None and getattr(weight, "op", "") != "get_attr":
        raise FrozenNodesNotFoundError(f"the layer_norm op at '{path}' takes a weight computed in the graph "
                                       f"({weight!r}), not a parameter; freeze its scale by hand")
    owner = pg.node(path).graph_module
    tensor = functools.reduce(getattr, weight.target.split("."), owner) if weight is not None else None
    return FrozenLayerNorm(argument_path(pg, path, call_argument(call, 0, "input")), path, tensor,
                           tuple(range(-len(shape), 0)), 1e-5 if eps is None else float(eps))


def _pattern(pg: PatchableGraph, path: str, query: str, key: str) -> FrozenPattern | None:
    """The :class:`FrozenPattern` of the SDPA call at ``path`` (its query and key at ``query`` and ``key``), or
    ``None`` for a call with dropout, a mask that is not a node, or a value that is not a node."""
    call = pg.node(path).fx_node
    mask = call_argument(call, 3, "attn_mask")
    if call_argument(call, 4, "dropout_p") not in (None, 0, 0.0) or (mask is not None and not hasattr(mask, "op")):
        return None
    try:
        value = argument_path(pg, path, call_argument(call, 2, "value"))
        mask_path = argument_path(pg, path, mask) if mask is not None else None
    except FrozenNodesNotFoundError:
        return None
    options = tuple((name, call_argument(call, index, name)) for index, name in ((5, "is_causal"), (6, "scale"),
                                                                            (7, "enable_gqa"))
                    if call_argument(call, index, name) is not None)
    if any(hasattr(option, "op") for _, option in options):
        return None
    return FrozenPattern(path, query, key, value, mask_path, options)


def _linearised(pg: PatchableGraph, path: str) -> LinearisedOp:
    """The :class:`LinearisedOp` of the elementwise op at ``path``: f(z) = op(z, *constants) for a function,
    z.op(*constants) for a method.

    Raises:
        FrozenNodesNotFoundError: the op takes a second tensor of the graph (it is not a function of one input), or
            its input is not a node.
    """
    call = pg.node(path).fx_node
    z, constants = call.args[0], call.args[1:]
    if any(hasattr(arg, "op") for arg in (*constants, *call.kwargs.values())):
        raise FrozenNodesNotFoundError(f"the {call.target} op at '{path}' (after the last frozen node) takes more than "
                                       f"one tensor of the graph, so it cannot be linearised as an elementwise op; "
                                       f"freeze it by hand")
    function = functools.partial(_apply, call.op == "call_method", call.target, constants, dict(call.kwargs))
    return LinearisedOp(argument_path(pg, path, z), path, function)


def _apply(method: bool, target: Any, constants: tuple[Any, ...], kwargs: dict[str, Any],
           z: torch.Tensor) -> torch.Tensor:
    """The op of a torch.fx node on ``z``: ``z.target(*constants, **kwargs)`` for a method (``target`` its name),
    else ``target(z, *constants, **kwargs)``."""
    return getattr(z, target)(*constants, **kwargs) if method else target(z, *constants, **kwargs)


def find_frozen_nodes(pg: PatchableGraph) -> FrozenNodes:
    """The attention and normalisation nodes of ``pg`` to freeze, and the elementwise nonlinearities after the last
    of them to linearise (module docstring; the graph's nodes are in the order they run).

    Raises:
        FrozenNodesNotFoundError: no attention-probability node (softmax ``[batch, heads, q, k]`` or SDPA call) or no
            normalisation scale (``rsqrt`` or ``layer_norm``), an op's argument that is not a node, or a nonlinearity
            after the last frozen node that takes two tensors; the message names what was looked for.
    """
    attention: list[str] = []
    norms: list[str] = []
    layer_norms: list[FrozenLayerNorm] = []
    patterns: list[FrozenPattern] = []
    paths = [path for path in pg.node_paths() if "|" not in path]
    last = -1
    for index, path in enumerate(paths):
        node = pg.node(path)
        op = node.op_name
        shape = node.tensor_shape
        if op in _SOFTMAX and shape is not None and len(shape) == 4:
            attention.append(path)
        elif op.endswith(_SDPA):
            call = pg.node(path).fx_node
            query, key = (argument_path(pg, path, call_argument(call, i, name))
                          for i, name in enumerate(("query", "key")))
            attention.extend((query, key))
            pattern = _pattern(pg, path, query, key)
            if pattern is not None:
                patterns.append(pattern)
        elif op in _RSQRT:
            norms.append(path)
        elif op == _LAYER_NORM:
            layer_norms.append(_layer_norm(pg, path))
        else:
            continue
        last = index
    missing = []
    if not attention:
        missing.append("attention probabilities (a softmax with value [batch, heads, query, key], or a "
                       "scaled_dot_product_attention call)")
    if not norms and not layer_norms:
        missing.append("normalisation scales (an rsqrt op, as RMSNorm computes, or a layer_norm op)")
    if missing:
        raise FrozenNodesNotFoundError(f"the local replacement model freezes {' and '.join(missing)}, but the graph "
                                       f"has none; print pg.graph to see its ops")
    linearised = tuple(_linearised(pg, path) for path in paths[last + 1:]
                       if pg.node(path).op_name in _ELEMENTWISE_OPS)
    return FrozenNodes(tuple(attention), tuple(norms), tuple(layer_norms), linearised, tuple(patterns))
