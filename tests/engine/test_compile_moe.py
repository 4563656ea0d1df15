"""``pg.compile()`` on mixture-of-experts models (issue 60): exact, really compiled, and never a dynamo error.

Extraction records transformers' eager kernel choice, ``torch._grouped_mm``, whose fake-tensor kernel accepts only
bfloat16: dynamo failed on it with a ``TorchRuntimeError`` (with ``backend="eager"`` too, so these tests compile with
a counting backend, cheap: guards and tracing, no inductor). Extraction now swaps it for an exact compilable
stand-in (gradpatch/extraction/compilable_ops.py), and any dynamo error runs the patch set eagerly with a warning.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

from gradpatch import AddPatch, CompilationWarning, PatchableGraph, ZeroPatch, testing
from gradpatch.extraction import compilable_ops, extractor


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


#: family -> (router-logits NodePath, MLP-output NodePath) in layer 0.
MOE = {
    "qwen3_moe": ("model.layers_0.mlp.gate.router_logits", "model.layers_0.mlp.output"),
    "mixtral": ("model.layers_0.mlp.gate.router_logits", "model.layers_0.mlp.experts.output"),
    "gpt_oss": ("model.layers_0.mlp.router.router_logits", "model.layers_0.mlp.experts.output"),
}


def _graphs(family: str) -> tuple[PatchableGraph, PatchableGraph, torch.Tensor]:
    """Two PatchableGraphs of a one-block tiny MoE model (the second stays eager, the reference) and example ids."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # gpt_oss: transformers' RoPE-scaling notice
        model = testing.tiny_causal_lm(family, layers=1)
    ids = torch.randint(0, 100, (2, 6), generator=torch.Generator().manual_seed(0))
    return PatchableGraph(model, ids, use_cache=False), PatchableGraph(model, ids, use_cache=False), ids


def _logits(pg: PatchableGraph, ids: torch.Tensor, patches: dict[str, Any]) -> torch.Tensor:
    with pg.patch(patches):
        return pg(ids, use_cache=False).logits


def _patch_sets(family: str) -> list[dict[str, Any]]:
    """An AddPatch at the router logits, then a ZeroPatch there with an AddPatch at the MLP output."""
    router, mlp = MOE[family]
    generator = torch.Generator().manual_seed(1)
    return [{router: AddPatch(value=3 * torch.randn(4, generator=generator))},
            {router: ZeroPatch(), mlp: AddPatch(value=torch.randn(32, generator=generator))}]


@pytest.mark.parametrize("family", sorted(MOE))
def test_pg_compile_of_a_moe_model_compiles_every_patch_set_exactly(family: str) -> None:
    pg, eager, ids = _graphs(family)
    backend = testing.CountingBackend()
    pg.compile(backend=backend, fullgraph=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CompilationWarning)  # compiled, not an eager fallback
        for count, patches in enumerate(_patch_sets(family), start=1):
            expected = _logits(eager, ids, patches)
            torch.testing.assert_close(_logits(pg, ids, patches), expected, atol=1e-6, rtol=0, msg=str(patches))
            assert backend.graphs == count  # one graph per patch set: dynamo compiled it, in one piece
    assert not torch.equal(expected, _logits(eager, ids, {}))


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_gradients_through_compiled_experts_equal_the_eager_ones(family: str) -> None:
    pg, eager, ids = _graphs(family)
    backend = testing.CountingBackend()
    pg.compile(backend=backend)
    delta = torch.zeros(32, requires_grad=True)
    gradients = []
    for graph in (eager, pg):
        with graph.patch({"model.layers_0.self_attn.o_proj.output": AddPatch(value=delta)}):
            (graph(ids, use_cache=False).logits[:, -1, :5] ** 2).sum().backward()
        gradients.append(delta.grad.clone())
        delta.grad = None
    assert backend.graphs >= 1 and gradients[0].abs().sum() > 0
    torch.testing.assert_close(gradients[1], gradients[0], atol=1e-6, rtol=0)


def test_the_grouped_mm_nodes_keep_their_names_and_operation() -> None:
    pg, _, _ = _graphs("qwen3_moe")
    node = pg.node("model.layers_0.mlp.experts.out")
    assert node._gp_op == "call_function:_grouped_mm"
    assert compilable_ops.compilable_target(torch.matmul) is torch.matmul


def test_a_dynamo_error_that_is_not_unsupported_runs_the_patch_set_eagerly_with_a_warning(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(extractor, "compilable_target", lambda target: target)  # graphs as before issue 60
    pg, eager, ids = _graphs("qwen3_moe")
    backend = testing.CountingBackend()
    pg.compile(backend=backend, fullgraph=True)
    router, _ = MOE["qwen3_moe"]
    patches = {router: AddPatch(value=torch.ones(4))}
    with pytest.warns(CompilationWarning, match=f"{router}.*runs eagerly.*TorchRuntimeError.*got RuntimeError.*BF16"):
        got = _logits(pg, ids, patches)
    assert torch.equal(got, _logits(eager, ids, patches))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once per patch set; the set stays eager
        assert torch.equal(_logits(pg, ids, patches), got)
    with pytest.warns(CompilationWarning, match="no node"):  # another set is tried on its own
        assert torch.equal(_logits(pg, ids, {}), _logits(eager, ids, {}))
    assert backend.graphs == 0


def test_a_forward_that_fails_eagerly_raises_its_own_error_not_dynamos(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(extractor, "compilable_target", lambda target: target)
    pg, _, ids = _graphs("mixtral")
    pg.compile(backend=testing.CountingBackend(), fullgraph=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CompilationWarning)
        with pytest.raises(IndexError):  # token ids past the vocabulary: the eager forward's error, no warning
            pg(ids + 400, use_cache=False)
    with pytest.warns(CompilationWarning, match="TorchRuntimeError"):  # the failed call did not decide the set
        pg(ids, use_cache=False)
