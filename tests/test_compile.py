"""torch.compile of a PatchableGraph computes what the eager graph computes under every patch set (issue 47).

Compiled with a counting backend that runs dynamo's graphs as they are (cheap: guards and tracing only, no
inductor); the speed of inductor-compiled graphs is measured by benchmarks/compile_overhead.py.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

import pytest
import torch
from torch import fx, nn

from gradpatch import (AddPatch, CompilationWarning, CustomPatch, PatchableGraph, ProbePatch,
                       RecordPatch, RotatedSubspacePatch, ZeroPatch, testing)


class CountingBackend:
    """A torch.compile backend that counts the graphs dynamo hands it and runs them unchanged."""

    def __init__(self) -> None:
        self.graphs = 0

    def __call__(self, graph_module: fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        self.graphs += 1
        return graph_module.forward


@pytest.fixture(autouse=True)
def fresh_dynamo() -> Any:
    torch.compiler.reset()
    yield
    torch.compiler.reset()


def _logits(output: Any) -> torch.Tensor:
    return output.logits if hasattr(output, "logits") else output[0]


def _model(family: str) -> tuple[nn.Module, str, str]:
    """A tiny model of ``family`` and two NodePaths: an MLP output (A) and a block output (B)."""
    if family == "llama":
        return testing.tiny_llama(100).eval(), "model.layers_0.mlp.down_proj.output", "model.layers_1.output"
    return testing.tiny_gpt2(100).eval(), "transformer.h_0.mlp.c_proj.output", "transformer.h_1.output"


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
    torch.manual_seed(0)
    model, a, b = _model(family)
    ids = torch.randint(0, 100, (2, 6))
    eager = PatchableGraph(model, ids, use_cache=False)
    pg = PatchableGraph(model, ids, use_cache=False)
    backend = CountingBackend()
    if how == "torch.compile":
        run: Callable[..., Any] = torch.compile(pg, backend=backend, fullgraph=True)
    else:
        pg.compile(backend=backend, fullgraph=True)
        run = pg
    compiles_after: list[int] = []
    for name, patches in _patch_sequence(a, b):
        with eager.patch(patches):
            expected = _logits(eager(ids, use_cache=False))
            probes = [p.activation.clone() for p in patches.values() if isinstance(p, ProbePatch)]
        for patch in patches.values():
            if isinstance(patch, ProbePatch):
                patch.activation = None
        with pg.patch(patches):
            got = _logits(run(ids, use_cache=False))
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=0, msg=name)
        for probe, value in zip([p for p in patches.values() if isinstance(p, ProbePatch)], probes):
            torch.testing.assert_close(probe.activation, value, atol=0, rtol=0)
        compiles_after.append(backend.graphs)
    # one compile per distinct patch set (none, zero A, add A, probe A, sliced add B); none when a set comes back
    assert compiles_after == [1, 2, 3, 4, 5, 5, 5]


@pytest.mark.parametrize("how", ["torch.compile", "pg.compile"])
def test_gradients_of_a_patch_value_through_the_compiled_graph(how: str) -> None:
    torch.manual_seed(0)
    model, a, _ = _model("llama")
    ids = torch.randint(0, 100, (2, 6))
    eager = PatchableGraph(model, ids, use_cache=False)
    pg = PatchableGraph(model, ids, use_cache=False)
    compiled: Callable[..., Any] = pg
    if how == "torch.compile":
        compiled = torch.compile(pg, backend=CountingBackend(), fullgraph=True)
    else:
        pg.compile(backend=CountingBackend())
    delta = torch.zeros(32, requires_grad=True)
    gradients = []
    for graph, run in ((eager, eager), (pg, compiled)):
        with graph.patch({a: AddPatch(value=delta)}):
            (_logits(run(ids, use_cache=False))[:, -1, :5] ** 2).sum().backward()
        gradients.append(delta.grad.clone())
        delta.grad = None
    assert gradients[0].abs().sum() > 0
    torch.testing.assert_close(gradients[1], gradients[0], rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("how", ["torch.compile", "pg.compile"])
def test_new_patch_values_never_recompile(how: str) -> None:
    torch.manual_seed(0)
    model, a, _ = _model("llama")
    ids = torch.randint(0, 100, (2, 6))
    eager = PatchableGraph(model, ids, use_cache=False)
    pg = PatchableGraph(model, ids, use_cache=False)
    backend = CountingBackend()
    run: Callable[..., Any] = pg
    if how == "torch.compile":
        run = torch.compile(pg, backend=backend)
    else:
        pg.compile(backend=backend)
    shared = torch.zeros(32)
    reused = AddPatch(value=shared)
    with pg.patch({a: reused}):
        run(ids, use_cache=False)
    compiles = backend.graphs
    for step in range(100):
        if step % 3 == 0:
            patch = AddPatch(value=torch.randn(32))  # a new patch object with a new tensor
        elif step % 3 == 1:
            shared.add_(0.5)  # the same tensor, updated in place
            patch = reused
        else:
            patch = AddPatch(value=shared)  # a new patch object around the updated tensor
        with pg.patch({a: patch}):
            got = _logits(run(ids, use_cache=False))
        if step % 10 == 0:
            with eager.patch({a: patch}):
                torch.testing.assert_close(got, _logits(eager(ids, use_cache=False)), atol=1e-5, rtol=0)
    assert backend.graphs == compiles


def test_trainable_patch_parameters_are_graph_inputs() -> None:
    torch.manual_seed(0)
    model, _, b = _model("llama")
    ids = torch.randint(0, 100, (4, 6))
    eager = PatchableGraph(model, ids, use_cache=False)
    pg = PatchableGraph(model, ids, use_cache=False)
    backend = CountingBackend()
    pg.compile(backend=backend, fullgraph=True)
    patch = RotatedSubspacePatch(32, 4)
    patch.source = torch.randn(4, 6, 32)
    optimizer = torch.optim.SGD(patch.parameters(), lr=0.1)
    for step in range(4):
        with pg.patch({b: patch}):
            loss = _logits(pg(ids, use_cache=False)).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        with torch.no_grad(), pg.patch({b: patch}), eager.patch({b: patch}):
            torch.testing.assert_close(_logits(pg(ids, use_cache=False)), _logits(eager(ids, use_cache=False)),
                                       atol=1e-5, rtol=0)
    assert backend.graphs <= 2  # grad mode and no_grad mode, compiled once each


def test_default_compile_over_four_shapes_compiles_at_most_twice() -> None:
    torch.manual_seed(0)
    model, a, _ = _model("llama")
    pg = PatchableGraph(model, torch.randint(0, 100, (2, 6)), use_cache=False)
    eager = PatchableGraph(model, torch.randint(0, 100, (2, 6)), use_cache=False)
    backend = CountingBackend()
    compiled = torch.compile(pg, backend=backend)
    with pg.patch({a: AddPatch(value=torch.ones(32))}), eager.patch({a: AddPatch(value=torch.ones(32))}):
        for shape in [(2, 16), (8, 128), (4, 64), (3, 100), (2, 16), (8, 128)]:
            ids = torch.randint(0, 100, shape)
            torch.testing.assert_close(_logits(compiled(ids, use_cache=False)), _logits(eager(ids, use_cache=False)),
                                       atol=1e-5, rtol=0)
    assert backend.graphs <= 2


def test_dynamic_shapes_compile_the_size_guards() -> None:
    torch.manual_seed(0)
    model, _, _ = _model("llama")
    pg = PatchableGraph(model, torch.randint(0, 100, (2, 6)), use_cache=False)
    compiled = torch.compile(pg, backend=CountingBackend(), dynamic=True, fullgraph=True)
    for shape in [(2, 5), (3, 9)]:
        ids = torch.randint(0, 100, shape)
        torch.testing.assert_close(_logits(compiled(ids, use_cache=False)), _logits(pg(ids, use_cache=False)),
                                   atol=1e-5, rtol=0)


def test_pg_compile_keeps_a_cache_per_patch_set_past_dynamos_recompile_limit() -> None:
    torch.manual_seed(0)
    model, _, _ = _model("llama")
    ids = torch.randint(0, 100, (2, 6))
    eager = PatchableGraph(model, ids, use_cache=False)
    pg = PatchableGraph(model, ids, use_cache=False)
    backend = CountingBackend()
    pg.compile(backend=backend, fullgraph=True)
    paths = [f"model.layers_{layer}.{node}" for layer in range(2)
             for node in ("mlp.down_proj.output", "output", "mlp.up_proj.output", "self_attn.o_proj.output",
                          "post_attention_layernorm.output")]
    assert len(paths) > torch._dynamo.config.recompile_limit
    for _ in range(2):
        for path in paths:
            patches = {path: ZeroPatch(slice=(slice(None), 1))}
            with pg.patch(patches), eager.patch(patches):
                torch.testing.assert_close(_logits(pg(ids, use_cache=False)), _logits(eager(ids, use_cache=False)),
                                           atol=1e-5, rtol=0)
    assert backend.graphs == len(paths)


def test_pg_compile_chooses_graphs_for_every_kind_of_call() -> None:
    torch.manual_seed(0)
    model, a, _ = _model("llama")
    ids = torch.randint(0, 100, (2, 6))
    eager = PatchableGraph(model, ids, use_cache=False)
    pg = PatchableGraph(model, ids, use_cache=False)
    pg.compile(backend=CountingBackend(), fullgraph=True)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    calls = [((ids[:1],), {"use_cache": False}), ((ids,), {"attention_mask": mask, "use_cache": False})]
    record, expected = RecordPatch(), RecordPatch()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # extraction of the new kinds of call
        for args, kwargs in calls:
            with pg.patch({a: [AddPatch(value=torch.ones(32)), record]}):
                got = _logits(pg(*args, **kwargs))
            with eager.patch({a: [AddPatch(value=torch.ones(32)), expected]}):
                torch.testing.assert_close(got, _logits(eager(*args, **kwargs)), atol=1e-5, rtol=0)
    assert len(record.activations) == 2
    for recorded, reference in zip(record.activations, expected.activations):
        torch.testing.assert_close(recorded, reference, atol=0, rtol=0)


def test_a_patch_set_dynamo_cannot_compile_runs_eagerly_with_a_warning() -> None:
    torch.manual_seed(0)
    model, a, _ = _model("llama")
    ids = torch.randint(0, 100, (2, 6))
    eager = PatchableGraph(model, ids, use_cache=False)
    pg = PatchableGraph(model, ids, use_cache=False)
    pg.compile(backend=CountingBackend(), fullgraph=True)
    seen: list[float] = []

    @torch.compiler.disable  # code torch.compile must not trace: a graph break, which fullgraph=True refuses
    def double_and_log(value: torch.Tensor) -> torch.Tensor:
        seen.append(float(value.abs().max()))
        return value * 2

    patches = {a: CustomPatch(custom_op=double_and_log)}
    with pytest.warns(CompilationWarning, match="runs eagerly"), pg.patch(patches):
        got = _logits(pg(ids, use_cache=False))
    with eager.patch(patches):
        torch.testing.assert_close(got, _logits(eager(ids, use_cache=False)), atol=1e-5, rtol=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once per patch set
        with pg.patch(patches):
            pg(ids, use_cache=False)
    assert len(seen) == 3


def test_torch_compile_of_pg_refuses_a_call_of_another_kind() -> None:
    torch.manual_seed(0)
    model, _, _ = _model("llama")
    ids = torch.randint(0, 100, (2, 6))
    pg = PatchableGraph(model, ids, use_cache=False)
    compiled = torch.compile(pg, backend=CountingBackend(), fullgraph=True)
    compiled(ids, use_cache=False)
    with pytest.raises(Exception) as error:
        compiled(ids, attention_mask=torch.ones_like(ids), use_cache=False)
    chain = []
    cause: BaseException | None = error.value
    while cause is not None:
        chain.append(str(cause))
        cause = cause.__cause__
    assert any("GradpatchError" in text and "'attention_mask' needs other graphs" in text and "pg.compile" in text
               for text in chain)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_patched_generation_through_a_compiled_graph(cache: str) -> None:
    torch.manual_seed(0)
    model, a, _ = _model("llama")
    ids = torch.randint(0, 100, (1, 6))
    eager = PatchableGraph(model, ids, use_cache=False)
    pg = PatchableGraph(model, ids, use_cache=False)
    pg.compile(backend=CountingBackend())
    patches = {a: AddPatch(value=torch.randn(32))}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # extraction of the prefill and decode steps' kinds of call
        with eager.patch(patches):
            expected = eager.generate(ids, max_new_tokens=8, do_sample=False, cache_implementation=cache)
            unpatched = model.generate(ids, max_new_tokens=8, do_sample=False, cache_implementation=cache)
        with pg.patch(patches):
            got = pg.generate(ids, max_new_tokens=8, do_sample=False, cache_implementation=cache)
    assert not torch.equal(expected, unpatched)
    assert torch.equal(got, expected)
