"""Property-based tests: random patches on tiny GPT-2 and Llama models equal the same operation done by hand with
PyTorch hooks on the eager model.

Each example draws one to three patches (``ZeroPatch``, ``AddPatch``, ``ReplacePatch``, ``CustomPatch``) at module
input and output nodes that hooks can reach, with random slices (ints, negative ints, slices with steps, ``Ellipsis``)
and values: tensors whose shapes do or do not broadcast to the sliced activation, or Python numbers. Properties:

- ``PatchShapeError`` exactly when a value does not broadcast to exactly the sliced activation's shape;
- otherwise the patched graph's logits equal the hooked eager model's, and so do the gradients with respect to every
  patch value;
- the model's weights are bit-identical afterwards, and the unpatched graph gives the eager outputs again.

The CI profile runs a bounded, derandomized set of examples; ``GRADPATCH_HYPOTHESIS_PROFILE=long`` runs many more
(random, with Hypothesis' example database) — see docs/reliability.md.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from editors.layers import resolve_module
from gradpatch import AddPatch, CustomPatch, Patch, PatchableGraph, PatchShapeError, ReplacePatch, ZeroPatch
from gradpatch.testing import tiny_gpt2, tiny_llama

PROFILES = {
    "ci": settings(max_examples=60, derandomize=True, database=None, deadline=None,
                   suppress_health_check=[HealthCheck.too_slow]),
    "long": settings(max_examples=10_000, deadline=None, suppress_health_check=[HealthCheck.too_slow]),
}
_PROFILE_NAME = os.environ.get("GRADPATCH_HYPOTHESIS_PROFILE", "ci")
if _PROFILE_NAME not in PROFILES:
    raise ValueError(f"GRADPATCH_HYPOTHESIS_PROFILE={_PROFILE_NAME!r}; use one of {sorted(PROFILES)}")
PROFILE = PROFILES[_PROFILE_NAME]

#: Nodes at module inputs and outputs (hooks reach them): ``<module path>.output`` or ``<module path>.<first arg>``.
NODES = {
    "llama": ("model.layers_0.mlp.x", "model.layers_0.mlp.down_proj.input", "model.layers_0.mlp.down_proj.output",
              "model.layers_1.mlp.act_fn.output", "model.layers_1.self_attn.o_proj.input", "lm_head.input",
              "lm_head.output"),
    "gpt2": ("transformer.h_0.mlp.hidden_states", "transformer.h_0.mlp.c_proj.x", "transformer.h_0.mlp.c_proj.output",
             "transformer.h_1.mlp.act.input", "transformer.h_1.attn.c_proj.output", "lm_head.output"),
}
KINDS = ("ZeroPatch", "AddPatch", "ReplacePatch", "CustomPatch")


@dataclass
class Case:
    """A model, its graph, example ids, the shape at every node, and the unpatched logits."""

    model: nn.Module
    pg: PatchableGraph
    ids: torch.Tensor
    shapes: dict[str, tuple[int, ...]]
    logits: torch.Tensor


def _hook(model: nn.Module, node: str, change: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """Register a hook that replaces the value at ``node`` by ``change(value)``; returns the handle."""
    module_path, _, name = node.rpartition(".")
    module = resolve_module(model, module_path)
    if name == "output":
        return module.register_forward_hook(lambda mod, args, out: change(out))

    def pre_hook(mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if args:
            return (change(args[0]), *args[1:]), kwargs
        return args, {**kwargs, name: change(kwargs[name])}

    return module.register_forward_pre_hook(pre_hook, with_kwargs=True)


def _build(kind: str) -> Case:
    torch.manual_seed(0)
    model = tiny_llama(50, hidden=16, intermediate=32) if kind == "llama" else tiny_gpt2(50, hidden=16)
    ids = torch.randint(0, 50, (2, 5), generator=torch.Generator().manual_seed(0))
    shapes: dict[str, tuple[int, ...]] = {}
    handles = []
    for node in NODES[kind]:
        def record(value: torch.Tensor, node: str = node) -> torch.Tensor:
            shapes[node] = tuple(value.shape)
            return value

        handles.append(_hook(model, node, record))
    with torch.no_grad():
        logits = model(ids, use_cache=False).logits
    for handle in handles:
        handle.remove()
    return Case(model, PatchableGraph(model, ids, use_cache=False), ids, shapes, logits)


CASES: dict[str, Case] = {}


def _case(kind: str) -> Case:
    if kind not in CASES:
        CASES[kind] = _build(kind)
    return CASES[kind]


@st.composite
def _component(draw: st.DrawFn, size: int) -> int | slice:
    """An int (negative ones included) or a slice (steps 1-3) indexing a dimension of ``size``."""
    if draw(st.booleans()):
        return draw(st.integers(-size, size - 1))
    bound = st.one_of(st.none(), st.integers(-size, size))
    return slice(draw(bound), draw(bound), draw(st.sampled_from([None, 1, 2, 3])))


@st.composite
def _index(draw: st.DrawFn, shape: tuple[int, ...]) -> Any:
    """A valid ``slice`` for an activation of ``shape``: ``None``, a bare int or slice, or a tuple with at most one
    ``Ellipsis`` (components before it index the leading dimensions, after it the trailing ones)."""
    form = draw(st.sampled_from(["none", "bare", "tuple", "ellipsis"]))
    if form == "none":
        return None
    if form == "bare":
        return draw(_component(shape[0]))
    if form == "tuple":
        n = draw(st.integers(1, len(shape)))
        return tuple(draw(_component(size)) for size in shape[:n])
    lead = draw(st.integers(0, len(shape)))
    trail = draw(st.integers(0, len(shape) - lead))
    return (*(draw(_component(size)) for size in shape[:lead]), Ellipsis,
            *(draw(_component(size)) for size in shape[len(shape) - trail:]))


def _broadcasts(value: tuple[int, ...], target: tuple[int, ...]) -> bool:
    """The documented rule: a value fits when it broadcasts to exactly the (sliced) activation's shape."""
    try:
        return tuple(torch.broadcast_shapes(value, target)) == target
    except RuntimeError:
        return False


@st.composite
def _value_shape(draw: st.DrawFn, target: tuple[int, ...], fits: bool) -> tuple[int, ...]:
    """A shape that broadcasts to ``target`` (trailing dimensions, some set to 1), or one that does not (one dimension
    of another size, or an extra leading dimension)."""
    kept = draw(st.integers(0, len(target)))
    shape = [size if draw(st.booleans()) else 1 for size in target[len(target) - kept:]]
    if fits:
        return tuple(shape)
    if shape and draw(st.booleans()):
        i = draw(st.integers(0, len(shape) - 1))
        shape[i] = target[len(target) - kept + i] + draw(st.integers(1, 3))
        return tuple(shape)
    return (draw(st.integers(1, 3)), *target)


#: A patch value: a tensor, a Python number (``AddPatch``/``ReplacePatch``), or ``None`` (``ZeroPatch``).
Value = torch.Tensor | float | None


@dataclass
class Spec:
    """One drawn patch: where, what, and its value."""

    node: str
    kind: str
    index: Any
    value: Value

    def fresh_value(self) -> Value:
        """A copy of the value for one run: tensors require grad, numbers stay numbers."""
        return self.value.clone().requires_grad_(True) if isinstance(self.value, torch.Tensor) else self.value

    def make(self, value: Value) -> Patch:
        if self.kind == "ZeroPatch":
            return ZeroPatch(slice=self.index)
        if self.kind == "AddPatch":
            return AddPatch(value=value, slice=self.index)
        if self.kind == "ReplacePatch":
            return ReplacePatch(value=value, slice=self.index)
        return CustomPatch(custom_op=lambda t: t.tanh() * value, slice=self.index)

    def by_hand(self, value: Value) -> Callable[[torch.Tensor], torch.Tensor]:
        """The patch's documented semantics, written out for a hook."""
        def change(t: torch.Tensor) -> torch.Tensor:
            selected = t if self.index is None else t[self.index]
            if self.kind == "ZeroPatch":
                new = torch.zeros_like(selected)
            elif self.kind == "AddPatch":
                new = selected + value
            elif self.kind == "ReplacePatch" and isinstance(value, float):
                new = torch.full_like(selected, value)
            elif self.kind == "ReplacePatch":
                new = value.expand(selected.shape).clone()  # a tensor of its own, as a hook would return
            else:
                new = selected.tanh() * value
            if self.index is None:
                return new
            out = t.clone()
            out[self.index] = new
            return out

        return change


@st.composite
def _specs(draw: st.DrawFn, kind: str) -> list[Spec]:
    case = _case(kind)
    specs = []
    for _ in range(draw(st.integers(1, 3))):
        node = draw(st.sampled_from(NODES[kind]))
        shape = case.shapes[node]
        index = draw(_index(shape))
        target = tuple(torch.empty(shape, device="meta")[() if index is None else index].shape)
        patch_kind = draw(st.sampled_from(KINDS))
        value: Value = None
        if patch_kind in ("AddPatch", "ReplacePatch") and draw(st.integers(0, 4)) == 0:
            value = draw(st.floats(-3.0, 3.0))
        elif patch_kind != "ZeroPatch":
            fits = patch_kind == "CustomPatch" or draw(st.integers(0, 5)) > 0  # mostly fitting values
            value_shape = draw(_value_shape(target, fits))
            seed = draw(st.integers(0, 2**16))
            value = torch.randn(value_shape, generator=torch.Generator().manual_seed(seed))
        specs.append(Spec(node, patch_kind, index, value))
    return specs


def _grads(loss: torch.Tensor, values: list[Value]) -> list[torch.Tensor]:
    """d loss / d value for each tensor value; zeros where no gradient reaches it (a later patch wiped its effect)."""
    given = [v for v in values if isinstance(v, torch.Tensor)]
    if not given or not loss.requires_grad:
        return [torch.zeros_like(v) for v in given]
    grads = torch.autograd.grad(loss, given, allow_unused=True)
    return [torch.zeros_like(v) if g is None else g for v, g in zip(given, grads)]


def _weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _check(kind: str, specs: list[Spec]) -> None:
    case = _case(kind)
    before = _weights(case.model)
    expect_error = any(isinstance(s.value, torch.Tensor) and not _broadcasts(
        tuple(s.value.shape), tuple(torch.empty(case.shapes[s.node], device="meta")[
            () if s.index is None else s.index].shape)) for s in specs)
    graph_values = [s.fresh_value() for s in specs]
    patch_map: dict[str, list[Patch]] = {}
    for spec, value in zip(specs, graph_values):
        patch_map.setdefault(spec.node, []).append(spec.make(value))
    weight = torch.randn(case.logits.shape, generator=torch.Generator().manual_seed(1))
    if expect_error:
        with pytest.raises(PatchShapeError):
            with case.pg.patch(patch_map):
                case.pg(case.ids, use_cache=False)
    else:
        with case.pg.patch(patch_map):
            logits = case.pg(case.ids, use_cache=False).logits
        graph_grads = _grads((logits * weight).sum(), graph_values)
        hand_values = [s.fresh_value() for s in specs]
        handles = [_hook(case.model, s.node, s.by_hand(v)) for s, v in zip(specs, hand_values)]
        try:
            expected = case.model(case.ids, use_cache=False).logits
        finally:
            for handle in handles:
                handle.remove()
        torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
        for got, want in zip(graph_grads, _grads((expected * weight).sum(), hand_values)):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    for name, parameter in case.model.named_parameters():
        assert torch.equal(parameter, before[name]), name
        assert parameter.grad is None, name
    with torch.no_grad():
        assert torch.equal(case.pg(case.ids, use_cache=False).logits, case.logits)  # no patch left behind


@PROFILE
@given(data=st.data())
@pytest.mark.parametrize("kind", sorted(NODES))
def test_patches_equal_hooks_on_the_eager_model(kind: str, data: st.DataObject) -> None:
    _check(kind, data.draw(_specs(kind)))


def test_a_broadcast_replace_value_feeds_a_view() -> None:
    """Found by the long profile: a broadcast ReplacePatch value must reach GPT-2's Conv1D ``.view()`` as a
    contiguous tensor, as a hook's own tensor would."""
    _check("gpt2", [Spec("transformer.h_0.mlp.hidden_states", "ReplacePatch", None, torch.randn(5, 1))])
