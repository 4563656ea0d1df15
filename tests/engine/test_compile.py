"""torch.compile of a PatchableGraph computes what the eager graph computes under every patch set (issue 47).

Compiled with a counting backend that runs dynamo's graphs as they are (cheap: guards and tracing only, no
inductor); the speed of inductor-compiled graphs is measured by benchmarks/engine/compile_overhead.py.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Callable

import pytest
import torch
from torch import nn

from gradpatch import (AddPatch, CompilationWarning, CustomPatch, PatchableGraph, ProbePatch,
                       RecordPatch, RotatedSubspacePatch, ZeroPatch, testing)


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


@contextlib.contextmanager
def compiled_only() -> Iterator[None]:
    """A :class:`CompilationWarning` (a patch set run eagerly instead of compiled) is an error in the block; the
    extraction of new kinds of call ("gradpatch: extracting graphs ...") is expected and ignored."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", CompilationWarning)
        warnings.filterwarnings("ignore", message="gradpatch: extracting graphs", category=UserWarning)
        yield


def _logits(output: Any) -> torch.Tensor:
    return output.logits if hasattr(output, "logits") else output[0]


@dataclass
class Setup:
    """A tiny model, two PatchableGraphs of it (one stays eager, the reference), example ids and two NodePaths: an
    MLP output (``a``) and a block output (``b``)."""

    model: nn.Module
    eager: PatchableGraph
    pg: PatchableGraph
    ids: torch.Tensor
    a: str
    b: str

    def assert_same(self, run: Callable[..., Any], patches: dict[str, Any], *args: Any, **kwargs: Any) -> None:
        """``run(*args, **kwargs)`` under ``patches`` on :attr:`pg` gives the eager graph's logits within 1e-5."""
        args = args or (self.ids,)
        kwargs = kwargs or {"use_cache": False}
        with self.pg.patch(patches):
            got = _logits(run(*args, **kwargs))
        with self.eager.patch(patches):
            torch.testing.assert_close(got, _logits(self.eager(*args, **kwargs)), atol=1e-5, rtol=0)


def _setup(family: str = "llama", rows: int = 2) -> Setup:
    torch.manual_seed(0)
    if family == "llama":
        model, a, b = testing.tiny_llama(100).eval(), "model.layers_0.mlp.down_proj.output", "model.layers_1.output"
    else:
        model, a, b = testing.tiny_gpt2(100).eval(), "transformer.h_0.mlp.c_proj.output", "transformer.h_1.output"
    ids = torch.randint(0, 100, (rows, 6))
    return Setup(model, PatchableGraph(model, ids, use_cache=False), PatchableGraph(model, ids, use_cache=False), ids,
                 a, b)


def _patch_sequence(a: str, b: str) -> list[tuple[str, dict[str, Any]]]:
    """The issue's sequence: no patch, Zero at A, Add at A, Probe at A, sliced Add at B, no patch, Add at A."""
    torch.manual_seed(1)
    value = torch.randn(32)
    return [("none", {}), ("zero A", {a: ZeroPatch()}), ("add A", {a: AddPatch(value=value)}),
            ("probe A", {a: ProbePatch()}), ("sliced add B", {b: AddPatch(value=value, slice=(slice(None), 2))}),
            ("none", {}), ("add A", {a: AddPatch(value=value)})]


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("how", ["torch.compile", "pg.compile"])
def test_compiled_graph_follows_every_patch_set(family: str, how: str) -> None:
    setup = _setup(family)
    backend = testing.CountingBackend()
    run = _compiled(setup.pg, how, backend=backend, fullgraph=True)
    compiles_after: list[int] = []
    for name, patches in _patch_sequence(setup.a, setup.b):
        probes = [p for p in patches.values() if isinstance(p, ProbePatch)]
        with setup.eager.patch(patches):
            expected = _logits(setup.eager(setup.ids, use_cache=False))
            probed = [p.activation.clone() for p in probes]
        for probe in probes:
            probe.activation = None
        with setup.pg.patch(patches):
            got = _logits(run(setup.ids, use_cache=False))
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=0, msg=name)
        for probe, value in zip(probes, probed):
            torch.testing.assert_close(probe.activation, value, atol=0, rtol=0)
        compiles_after.append(backend.graphs)
    # one compile per distinct patch set (none, zero A, add A, probe A, sliced add B); none when a set comes back
    assert compiles_after == [1, 2, 3, 4, 5, 5, 5]


@pytest.mark.parametrize("how", ["torch.compile", "pg.compile"])
def test_gradients_of_a_patch_value_through_the_compiled_graph(how: str) -> None:
    setup = _setup()
    backend = testing.CountingBackend()
    compiled = _compiled(setup.pg, how, backend=backend)
    delta = torch.zeros(32, requires_grad=True)
    gradients = []
    with compiled_only():
        for graph, run in ((setup.eager, setup.eager), (setup.pg, compiled)):
            with graph.patch({setup.a: AddPatch(value=delta)}):
                (_logits(run(setup.ids, use_cache=False))[:, -1, :5] ** 2).sum().backward()
            gradients.append(delta.grad.clone())
            delta.grad = None
    assert backend.graphs == 1  # the patched forward was compiled (and its backward ran through that graph)
    assert gradients[0].abs().sum() > 0
    torch.testing.assert_close(gradients[1], gradients[0], rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("how", ["torch.compile", "pg.compile"])
def test_new_patch_values_never_recompile(how: str) -> None:
    setup = _setup()
    backend = testing.CountingBackend()
    run = _compiled(setup.pg, how, backend=backend)
    shared = torch.zeros(32)
    reused = AddPatch(value=shared)
    with setup.pg.patch({setup.a: reused}):
        run(setup.ids, use_cache=False)
    compiles = backend.graphs
    for step in range(100):
        if step % 3 == 0:
            patch = AddPatch(value=torch.randn(32))  # a new patch object with a new tensor
        elif step % 3 == 1:
            shared.add_(0.5)  # the same tensor, updated in place
            patch = reused
        else:
            patch = AddPatch(value=shared)  # a new patch object around the updated tensor
        if step % 10 == 0:
            setup.assert_same(run, {setup.a: patch})
        else:
            with setup.pg.patch({setup.a: patch}):
                run(setup.ids, use_cache=False)
    assert backend.graphs == compiles


def test_trainable_patch_parameters_are_graph_inputs() -> None:
    setup = _setup(rows=4)
    backend = testing.CountingBackend()
    setup.pg.compile(backend=backend, fullgraph=True)
    patch = RotatedSubspacePatch(32, 4)
    patch.source = torch.randn(4, 6, 32)
    optimizer = torch.optim.SGD(patch.parameters(), lr=0.1)
    for _ in range(4):
        with setup.pg.patch({setup.b: patch}):
            loss = _logits(setup.pg(setup.ids, use_cache=False)).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        with torch.no_grad():
            setup.assert_same(setup.pg, {setup.b: patch})
    assert 1 <= backend.graphs <= 2  # grad mode and no_grad mode, compiled once each


def test_default_compile_over_four_shapes_compiles_at_most_twice() -> None:
    setup = _setup()
    backend = testing.CountingBackend()
    compiled = torch.compile(setup.pg, backend=backend)
    patches = {setup.a: AddPatch(value=torch.ones(32))}
    for shape in [(2, 16), (8, 128), (4, 64), (3, 100), (2, 16), (8, 128)]:
        setup.assert_same(compiled, patches, torch.randint(0, 100, shape), use_cache=False)
    assert 1 <= backend.graphs <= 2


def test_dynamic_shapes_compile_the_size_guards() -> None:
    setup = _setup()
    backend = testing.CountingBackend()
    compiled = torch.compile(setup.pg, backend=backend, dynamic=True, fullgraph=True)
    for shape in [(2, 5), (3, 9)]:
        setup.assert_same(compiled, {}, torch.randint(0, 100, shape), use_cache=False)
    assert backend.graphs == 1  # one graph with symbolic sizes serves both shapes


def test_pg_compile_keeps_a_cache_per_patch_set_past_dynamos_recompile_limit() -> None:
    setup = _setup()
    backend = testing.CountingBackend()
    setup.pg.compile(backend=backend, fullgraph=True)
    paths = [f"model.layers_{layer}.{node}" for layer in range(2)
             for node in ("mlp.down_proj.output", "output", "mlp.up_proj.output", "self_attn.o_proj.output",
                          "post_attention_layernorm.output")]
    assert len(paths) > torch._dynamo.config.recompile_limit
    for _ in range(2):
        for path in paths:
            setup.assert_same(setup.pg, {path: ZeroPatch(slice=(slice(None), 1))})
    assert backend.graphs == len(paths)


def test_pg_compile_chooses_graphs_for_every_kind_of_call() -> None:
    setup = _setup()
    backend = testing.CountingBackend()
    setup.pg.compile(backend=backend, fullgraph=True)
    mask = torch.ones_like(setup.ids)
    mask[0, :2] = 0
    calls = [((setup.ids[:1],), {"use_cache": False}), ((setup.ids,), {"attention_mask": mask, "use_cache": False})]
    record, expected = RecordPatch(), RecordPatch()
    with compiled_only():
        for args, kwargs in calls:
            with setup.pg.patch({setup.a: [AddPatch(value=torch.ones(32)), record]}):
                got = _logits(setup.pg(*args, **kwargs))
            with setup.eager.patch({setup.a: [AddPatch(value=torch.ones(32)), expected]}):
                torch.testing.assert_close(got, _logits(setup.eager(*args, **kwargs)), atol=1e-5, rtol=0)
    assert backend.graphs == 2  # each kind of call compiled
    assert len(record.activations) == 2
    for recorded, reference in zip(record.activations, expected.activations):
        torch.testing.assert_close(recorded, reference, atol=0, rtol=0)


def test_a_patch_set_dynamo_cannot_compile_runs_eagerly_with_a_warning() -> None:
    setup = _setup()
    setup.pg.compile(backend=testing.CountingBackend(), fullgraph=True)
    seen: list[float] = []

    @torch.compiler.disable  # code torch.compile must not trace: a graph break, which fullgraph=True refuses
    def double_and_log(value: torch.Tensor) -> torch.Tensor:
        seen.append(float(value.detach().abs().max()))
        return value * 2

    patches = {setup.a: CustomPatch(custom_op=double_and_log)}
    with pytest.warns(CompilationWarning, match="runs eagerly"):
        setup.assert_same(setup.pg, patches)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once per patch set
        with setup.pg.patch(patches):
            setup.pg(setup.ids, use_cache=False)
    assert len(seen) == 3


def test_torch_compile_of_pg_refuses_a_call_of_another_kind() -> None:
    setup = _setup()
    compiled = torch.compile(setup.pg, backend=testing.CountingBackend(), fullgraph=True)
    compiled(setup.ids, use_cache=False)
    with pytest.raises(Exception) as error:
        compiled(setup.ids, attention_mask=torch.ones_like(setup.ids), use_cache=False)
    chain = []
    cause: BaseException | None = error.value
    while cause is not None:
        chain.append(str(cause))
        cause = cause.__cause__
    assert any("GradpatchError" in text and "'attention_mask' needs other graphs" in text and "pg.compile" in text
               for text in chain)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_patched_generation_through_a_compiled_graph(cache: str) -> None:
    setup = _setup(rows=1)
    backend = testing.CountingBackend()
    setup.pg.compile(backend=backend)
    patches = {setup.a: AddPatch(value=torch.randn(32))}
    options = {"max_new_tokens": 8, "do_sample": False, "cache_implementation": cache}
    with compiled_only():
        with setup.eager.patch(patches):
            expected = setup.eager.generate(setup.ids, **options)
        unpatched = setup.model.generate(setup.ids, **options)
        with setup.pg.patch(patches):
            got = setup.pg.generate(setup.ids, **options)
    assert not torch.equal(expected, unpatched)
    assert torch.equal(got, expected)
    assert backend.graphs >= 2  # the prefill and the decode steps compiled


def _compiled(pg: PatchableGraph, how: str, **compile_kwargs: Any) -> Callable[..., Any]:
    """``pg`` compiled by ``torch.compile(pg, ...)`` (returns the compiled module) or ``pg.compile(...)`` (returns
    ``pg``, compiled in place)."""
    if how == "torch.compile":
        return torch.compile(pg, **compile_kwargs)
    pg.compile(**compile_kwargs)
    return pg
