"""Repeated modules reuse one traced graph (gradpatch.extraction.reuse): the same graphs as tracing each one, and
never a graph traced for a module that differs in what its code reads."""

from __future__ import annotations

import pytest
import torch
from torch import fx, nn

from gradpatch import ExtractionOptions, PatchableGraph
from gradpatch.errors import ShapeSpecializationError
from gradpatch.extraction.reuse import graph_reuse_disabled
from gradpatch.extraction.tracer import OutputRebuilder
from gradpatch.testing import tiny_causal_lm


def _graph_modules(pg: PatchableGraph) -> dict[str, fx.GraphModule]:
    return {name: module for name, module in pg.named_modules() if isinstance(module, fx.GraphModule)}


def _description(module: fx.GraphModule) -> list[tuple]:
    def target(node: fx.Node) -> object:  # a rebuilder of the return value is made per trace: compare its structure
        return str(node.target.spec) if isinstance(node.target, OutputRebuilder) else node.target

    return [(node.name, node.op, target(node), repr(node.args), repr(node.kwargs), node.meta.get("gp_info"))
            for node in module.graph.nodes]


@pytest.mark.parametrize("family", ["llama", "gpt2", "qwen3"])
def test_reused_graphs_equal_traced_ones(family: str) -> None:
    model = tiny_causal_lm(family, layers=3)
    ids = torch.randint(0, 100, (1, 7), generator=torch.Generator().manual_seed(0))
    reused = PatchableGraph(model, ids, use_cache=False)
    with graph_reuse_disabled():
        traced = PatchableGraph(model, ids, use_cache=False)
    assert reused.node_paths() == traced.node_paths()
    assert repr(reused.graph) == repr(traced.graph)
    reused_modules, traced_modules = _graph_modules(reused), _graph_modules(traced)
    assert list(reused_modules) == list(traced_modules)
    for name, module in reused_modules.items():
        assert module.code == traced_modules[name].code, name
        assert _description(module) == _description(traced_modules[name]), name
    shared = [name for name, module in reused_modules.items()
              if any(other is not module and other.graph is module.graph for other in reused_modules.values())]
    assert shared  # the later layers hold their first layer's graphs
    assert not any(other is not module and other.graph is module.graph for module in traced_modules.values()
                   for other in traced_modules.values())
    with torch.no_grad():
        expected = model(ids, use_cache=False).logits
        assert torch.equal(reused(ids, use_cache=False).logits, expected)
        longer = torch.randint(0, 100, (2, 9), generator=torch.Generator().manual_seed(1))
        reused.prepare(longer, use_cache=False)  # the batched variant: extracted with reuse too
        assert torch.equal(reused(longer, use_cache=False).logits, model(longer, use_cache=False).logits)


@pytest.mark.slow
def test_smollm2_reused_graphs_equal_traced_ones(smollm2) -> None:
    model, tokenizer = smollm2
    ids = tokenizer("The Eiffel Tower is located in the city of", return_tensors="pt").input_ids
    reused = PatchableGraph(model, ids, use_cache=False)
    with graph_reuse_disabled():
        traced = PatchableGraph(model, ids, use_cache=False)
    assert reused.node_paths() == traced.node_paths()
    reused_modules, traced_modules = _graph_modules(reused), _graph_modules(traced)
    assert list(reused_modules) == list(traced_modules)
    for name, module in reused_modules.items():
        assert module.code == traced_modules[name].code, name
        assert _description(module) == _description(traced_modules[name]), name
    layers = reused._graph_module.model.layers
    assert all(layer.self_attn.graph is layers[0].self_attn.graph for layer in layers)
    with torch.no_grad():
        assert torch.equal(reused(ids, use_cache=False).logits, traced(ids, use_cache=False).logits)


class _Scale(nn.Module):
    def __init__(self, factor: float, shift: bool = False) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.factor = factor
        self.shift = shift

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _scaled(self, self.linear(x))
        if self.shift:
            y = y + 1
        return y


def _scaled(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return x * module.factor  # read through a helper, as transformers' attention functions read their module


class _Other(_Scale):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) - self.factor


class _Stack(nn.Module):
    def __init__(self, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.stem = nn.Linear(4, 4)  # every block's input is then a tensor with a gradient, as in a transformer
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return x


@pytest.mark.parametrize("second", [_Scale(2.0), _Scale(-0.0), _Scale(1.0, shift=True), _Other(1.0)],
                         ids=["constant", "negative-zero", "branch-attribute", "code"])
def test_modules_differing_in_what_their_code_reads_get_their_own_graphs(second: nn.Module) -> None:
    torch.manual_seed(0)
    model = _Stack([_Scale(1.0), second, _Scale(1.0)])
    x = torch.randn(2, 4)
    pg = PatchableGraph(model, x)
    first, other, third = (pg._graph_module.blocks[index] for index in range(3))
    assert third.graph is first.graph  # the same class, attributes and call: reused
    assert other.graph is not first.graph
    assert other.code != first.code
    with graph_reuse_disabled():
        traced = PatchableGraph(model, x)
    assert other.code == traced._graph_module.blocks[1].code
    with torch.no_grad():
        assert torch.equal(pg(x), model(x))


def test_a_different_parameter_layout_or_input_gets_its_own_graph() -> None:
    torch.manual_seed(0)
    without_bias = _Scale(1.0)
    without_bias.linear = nn.Linear(4, 4, bias=False)
    model = _Stack([_Scale(1.0), without_bias])
    x = torch.randn(2, 4)
    pg = PatchableGraph(model, x)
    blocks = pg._graph_module.blocks
    assert blocks[1].graph is blocks[0].graph  # the blocks' own code runs alike: the linear layer is a call
    assert blocks[1].linear.graph is not blocks[0].linear.graph
    assert "blocks_0.linear.bias" in pg.node_paths()
    assert "blocks_1.linear.bias" not in pg.node_paths()
    with torch.no_grad():
        assert torch.equal(pg(x), model(x))

    class Widen(nn.Module):  # the second block sees another shape: traced, not reused
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.cat([x, x], dim=-1)

    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first, self.widen, self.second = Widen(), Widen(), Widen()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.second(self.widen(self.first(x)))

    model = Twice()
    pg = PatchableGraph(model, x)
    assert pg._graph_module.widen.graph is not pg._graph_module.first.graph
    assert pg(x).shape == (2, 32)


class _Sized(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[1] > 2:  # a size decision: a guard in the graph
            return x * 2
        return x


def test_a_failed_guard_in_a_reused_graph_names_its_own_module() -> None:
    model = _Stack([_Sized(), _Sized()])
    pg = PatchableGraph(model, torch.randn(1, 3, 4))
    second = pg._graph_module.blocks[1]
    assert second.graph is pg._graph_module.blocks[0].graph
    with pytest.raises(ShapeSpecializationError, match="in 'blocks_1'"):
        second(torch.randn(1, 2, 4))
    with pytest.raises(ShapeSpecializationError, match="in 'blocks_0'"):
        pg(torch.randn(1, 2, 4))


def test_recording_leaves_the_classes_as_they_were() -> None:
    model = _Stack([_Scale(1.0), _Scale(1.0)])
    PatchableGraph(model, torch.randn(2, 4))
    assert "__getattribute__" not in vars(_Scale)
    assert "__getattribute__" not in vars(nn.Linear)


def test_a_postprocessing_function_edits_each_graph_on_its_own() -> None:
    def double_first_block(root: nn.Module, original: nn.Module) -> None:
        graph = root.blocks[0].graph
        output = next(node for node in graph.nodes if node.op == "output")
        with graph.inserting_before(output):
            doubled = graph.call_function(torch.mul, (output.args[0], 2))
        output.args = (doubled,)

    torch.manual_seed(0)
    model = _Stack([_Scale(1.0), _Scale(1.0)])
    x = torch.randn(2, 4)
    pg = PatchableGraph(model, ExtractionOptions(postprocessing_function=double_first_block), x)
    assert pg._graph_module.blocks[1].graph is not pg._graph_module.blocks[0].graph
    with torch.no_grad():
        expected = model.blocks[1](model.blocks[0](model.stem(x)) * 2)
        assert torch.equal(pg(x), expected)
