"""ExtractionOptions, the opaque fallback, multiply invoked modules and train/eval reaching every wrapper."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gradpatch import (
    AddPatch,
    CompiledGraphModule,
    ExtractionError,
    ExtractionOptions,
    MultiplyInvokedModule,
    OpaqueGraphModule,
    PatchableGraph,
    ProbePatch,
    ShapeSpecializationError,
    ZeroPatch,
)


class DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(3, 3)
        self.scale = nn.Parameter(torch.tensor(2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.inner(x)
        if hidden.sum() > 0:  # control flow on tensor values: no single graph exists
            return hidden * self.scale
        return -hidden


class WithContextManager(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            frozen = self.inner(x)
        return frozen + x


class Outer(nn.Module):
    def __init__(self, child: nn.Module) -> None:
        super().__init__()
        self.child = child
        self.head = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.child(x))


@pytest.mark.parametrize("child_class", [DataDependent, WithContextManager])
def test_opaque_fallback_keeps_children_patchable(child_class):
    torch.manual_seed(0)
    model = Outer(child_class())
    x = torch.randn(4, 3)
    pg = PatchableGraph(model, x)
    child = pg._graph_module.child
    assert isinstance(child, OpaqueGraphModule)
    assert isinstance(child.inner, CompiledGraphModule)
    assert {"x", "inner", "output"} <= set(dir(pg.graph.child))
    torch.testing.assert_close(pg(x), model(x))
    probe = ProbePatch()
    with pg.patch({"child.inner.linear": probe, "child.output": ZeroPatch()}):
        out = pg(x)
    torch.testing.assert_close(out, model.head.bias.expand(4, 2))
    torch.testing.assert_close(probe.activation, model.child.inner(x).detach())
    with pg.patch({"child.x": AddPatch(value=torch.ones(3))}):
        torch.testing.assert_close(pg(x), model(x + 1))


def test_opaque_parameter_patch():
    torch.manual_seed(0)
    model = Outer(DataDependent())
    x = torch.ones(2, 3)
    pg = PatchableGraph(model, x)
    with pg.patch({"child.scale": AddPatch(value=torch.tensor(1.0))}):
        patched = pg(x)
    with torch.no_grad():
        model.child.scale += 1
    expected = model(x)
    with torch.no_grad():
        model.child.scale -= 1
    torch.testing.assert_close(patched, expected)


def test_error_on_compilation_failure():
    with pytest.raises(ExtractionError, match="child"):
        PatchableGraph(ExtractionOptions(error_on_compilation_failure=True), Outer(DataDependent()), torch.randn(2, 3))


def test_skip_options():
    model = Outer(WithContextManager())
    x = torch.randn(2, 3)
    pg = PatchableGraph(ExtractionOptions(skip_compilation=True), model, x)
    assert isinstance(pg._graph_module, OpaqueGraphModule)
    assert isinstance(pg._graph_module.head, OpaqueGraphModule)
    torch.testing.assert_close(pg(x), model(x))
    pg = PatchableGraph(ExtractionOptions(classes_to_skip_compiling={nn.Linear}), model, x)
    assert isinstance(pg._graph_module, CompiledGraphModule)
    assert isinstance(pg._graph_module.head, OpaqueGraphModule)


def test_custom_extraction_function():
    class Simplified(nn.Module):
        def __init__(self, original: WithContextManager) -> None:
            super().__init__()
            self.inner = original.inner

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.inner(x).detach() + x

    model = Outer(WithContextManager())
    x = torch.randn(2, 3)
    options = ExtractionOptions(custom_extraction_functions={WithContextManager: Simplified})
    pg = PatchableGraph(options, model, x)
    assert isinstance(pg._graph_module.child, CompiledGraphModule)
    assert "detach" in dir(pg.graph.child)
    torch.testing.assert_close(pg(x), model(x))


def test_multiply_invoked_inside_opaque_parent():
    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(3, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.sum() > -1e9:
                return self.linear(self.linear(x))
            return x

    torch.manual_seed(0)
    model = Twice()
    x = torch.randn(2, 3)
    pg = PatchableGraph(model, x)
    assert isinstance(pg._graph_module, OpaqueGraphModule)
    assert isinstance(pg._graph_module.linear, MultiplyInvokedModule)
    with pg.patch({"linear_1.output": ZeroPatch()}):
        assert torch.count_nonzero(pg(x)) == 0
    with pg.patch({"linear_0.output": ZeroPatch()}):
        torch.testing.assert_close(pg(x), model.linear(torch.zeros(2, 3)))


def test_train_and_eval_reach_dropout(mlp):
    x = torch.randn(64, 4)
    pg = PatchableGraph(mlp, x)
    torch.testing.assert_close(pg(x)["out"], pg(x)["out"])
    pg.train()
    assert mlp.training and all(module.training for module in pg._graph_module.modules())
    torch.manual_seed(1)
    first = pg(x)["out"]
    torch.manual_seed(2)
    assert not torch.allclose(first, pg(x)["out"])
    torch.manual_seed(1)
    torch.testing.assert_close(first, mlp(x)["out"])
    pg.eval()
    assert not mlp.training and not any(module.training for module in pg._graph_module.modules())
    torch.testing.assert_close(pg(x)["out"], mlp(x)["out"])


def test_size_guard_raises_when_a_decision_changes():
    class Branchy(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.shape[0] > 2:
                return x * 2
            return x

    pg = PatchableGraph(Branchy(), torch.randn(3, 4))
    torch.testing.assert_close(pg(torch.ones(5, 4)), torch.full((5, 4), 2.0))
    with pytest.raises(ShapeSpecializationError, match="example inputs shaped like this call"):
        pg(torch.ones(2, 4))


def test_eval_reaches_opaque_wrappers_and_to_same_device_keeps_graphs(tiny_llama, token_ids):
    pg = PatchableGraph(tiny_llama, token_ids, use_cache=False).eval()
    assert not [name for name, module in pg.named_modules() if module.training]
    graphs = pg._graph_module
    pg.to("cpu")
    assert pg._graph_module is graphs
