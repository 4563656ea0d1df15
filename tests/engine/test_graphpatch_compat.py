"""graphpatch's calling conventions and behaviours, each one a difference its own test suite found (issue 13)."""

from __future__ import annotations

import io
import warnings
from dataclasses import dataclass

import pytest
import torch
from torch import fx, nn

from gradpatch import (
    AddPatch,
    CompilationWarning,
    CustomPatch,
    ExtractionError,
    ExtractionOptions,
    MultiplyInvokedModule,
    NodePathError,
    OpaqueGraphModule,
    Patch,
    PatchableGraph,
    ProbePatch,
    ReplacePatch,
    UnusedModule,
    ZeroPatch,
)


class Aliased(nn.Module):
    """One Linear under several names and containers (graphpatch's ContainerModule, smaller)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 3)
        self.duped_linear = self.linear
        self.module_dict = nn.ModuleDict({"foo": self.linear, "bar": nn.ModuleList([self.linear, nn.Linear(3, 3)])})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.duped_linear(x) - self.module_dict["foo"](x)
        for index in range(2):
            y = y + self.module_dict["bar"][index](x) * self.linear(x)
        return y


class Varargs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor, *foos: torch.Tensor, blah: int = 3, **bars: torch.Tensor) -> torch.Tensor:
        result = self.linear(x)
        for foo in foos:
            result = result + foo
        return self.linear(result + blah) + sum(bars.values())


class AssignsIntoChildOutput(nn.Module):
    class Child(nn.Module):
        def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
            return [x * 2, x + 1]

    def __init__(self) -> None:
        super().__init__()
        self.child = self.Child()
        self.linear = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outputs = self.child(x)
        outputs[0] = self.linear(outputs[1])
        return outputs[0] + outputs[1]


class Attributes(nn.Module):
    scale = 5

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 3)
        self.offset = 2.0
        self.unused = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch._dynamo.graph_break()
        return self.linear(x) * self.scale + self.offset


@dataclass(kw_only=True)
class RankOnePatch(Patch[torch.Tensor]):
    """A user patch in graphpatch's style (a generic subclass with its own fields), adding ``key ⊗ value``."""

    key: torch.Tensor
    value: torch.Tensor

    def op(self, original: torch.Tensor) -> torch.Tensor:
        original += torch.outer(self.value, self.key)  # in place: the patch gets a copy
        return original


def test_options_after_the_module_and_before_it():
    torch.manual_seed(0)
    model, x = Aliased(), torch.randn(2, 3)
    for pg in (PatchableGraph(model, ExtractionOptions(skip_compilation=True), x),
               PatchableGraph(ExtractionOptions(skip_compilation=True), model, x)):
        assert isinstance(pg._graph_module, OpaqueGraphModule)
        torch.testing.assert_close(pg(x), model(x))


def test_call_sites_keep_their_attribute_names_and_the_hierarchy():
    torch.manual_seed(0)
    model, x = Aliased(), torch.randn(2, 3)
    for options in (ExtractionOptions(error_on_compilation_failure=True), ExtractionOptions(skip_compilation=True)):
        pg = PatchableGraph(model, options, x)
        names = set(dir(pg.graph))
        assert {"duped_linear", "module_dict_foo", "module_dict_bar_0", "module_dict_bar_1", "linear_0",
                "linear_1"} <= names
        assert isinstance(pg._graph_module.linear, MultiplyInvokedModule)
        assert isinstance(pg._graph_module.linear, nn.ModuleList)
        torch.testing.assert_close(pg._graph_module.linear[1](x), model.linear(x))
        assert pg._graph_module.module_dict["bar"][1].original_module is model.module_dict["bar"][1]
        with pg.patch({"module_dict_foo.output": ZeroPatch()}):
            torch.testing.assert_close(pg(x), model(x) + model.linear(x))


def test_varargs_and_kwargs_are_digs_of_one_input():
    torch.manual_seed(0)
    model, x = Varargs(), torch.randn(3, 3)
    foos, bars = (torch.ones(3, 3), torch.ones(3, 3)), {"a": torch.ones(3, 3)}
    pg = PatchableGraph(model, x, *foos, **bars)
    assert pg.graph.foos.sub_1._path == "foos|sub_1" and pg.graph.bars.a._path == "bars|a"
    with pg.patch({pg.graph.foos.sub_0: AddPatch(value=1), "bars|a": AddPatch(value=2)}):
        patched = pg(x, *foos, **bars)
    torch.testing.assert_close(patched, model(x, foos[0] + 1, foos[1], a=bars["a"] + 2))
    with pytest.raises(NodePathError, match="baked its value"):
        with pg.patch({"blah": AddPatch(value=1)}):
            pass


def test_assignment_into_a_child_output_compiles():
    torch.manual_seed(0)
    model, x = AssignsIntoChildOutput(), torch.randn(2, 3)
    pg = PatchableGraph(model, ExtractionOptions(error_on_compilation_failure=True), x)
    torch.testing.assert_close(pg(x), model(x))
    with pg.patch({"linear.output": ZeroPatch()}):
        torch.testing.assert_close(pg(x), x + 1)


def test_patches_never_write_to_weights():
    torch.manual_seed(0)
    linear, x = nn.Linear(3, 3), torch.randn(2, 3)
    weight = linear.weight.detach().clone()
    key, value = torch.randn(3), torch.randn(3)
    for options in (ExtractionOptions(), ExtractionOptions(skip_compilation=True)):
        pg = PatchableGraph(linear, options, x)
        for grad in (True, False):
            with torch.set_grad_enabled(grad):
                with pg.patch({"weight": [CustomPatch(custom_op=lambda t: t.add_(1)), probe := ProbePatch()]}):
                    pg(x)
                torch.testing.assert_close(probe.activation, weight + 1)
                with pg.patch({"weight": RankOnePatch(key=key, value=value)}):
                    out = pg(x)
                torch.testing.assert_close(out, x @ (weight + torch.outer(value, key)).T + linear.bias)
            assert torch.equal(linear.weight, weight)


def test_python_numbers_as_values():
    torch.manual_seed(0)
    linear, x = nn.Linear(3, 3), torch.randn(2, 3)
    pg = PatchableGraph(linear, x)
    with pg.patch({"output": ReplacePatch(value=3, slice=(slice(None), 1))}):
        out = pg(x)
    assert torch.equal(out[:, 1], torch.full((2,), 3.0))
    with pg.patch({"weight": AddPatch(value=1)}):
        torch.testing.assert_close(pg(x), x @ (linear.weight + 1).T + linear.bias)
    with pytest.raises(TypeError, match="tensor or a Python number"):
        AddPatch(value="1")
    with pytest.raises(TypeError, match="value"):
        ReplacePatch()  # type: ignore[call-arg]


def test_container_without_dig_is_a_key_error(tuple_module):
    pg = PatchableGraph(tuple_module, torch.randn(2, 3))
    for key in ("output", pg.graph.output, "nothing.output", "linear_0..output"):
        with pytest.raises(KeyError):
            with pg.patch({key: ZeroPatch()}):
                pass


class Skips(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(3, 3) for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers[2](self.layers[0](x))


def test_unused_submodules_and_warnings():
    x = torch.randn(2, 3)
    with pytest.raises(ExtractionError, match="'layers_1' was never called.*allow_unused_submodules=True"):
        PatchableGraph(Skips(), ExtractionOptions(error_on_compilation_failure=True), x)
    PatchableGraph(Skips(), ExtractionOptions(error_on_compilation_failure=True, allow_unused_submodules=True), x)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pg = PatchableGraph(nn.Sequential(Attributes()), ExtractionOptions(warn_on_compilation_failure=True), x)
    messages = [str(warning.message) for warning in caught if warning.category is CompilationWarning]
    assert any("graph_break" in message for message in messages)
    assert isinstance(pg._graph_module.get_submodule("0"), OpaqueGraphModule)  # graph_break(): opaque, as torch.compile breaks


def test_opaque_modules_expose_their_attributes():
    torch.manual_seed(0)
    model, x = Attributes(), torch.randn(2, 3)
    pg = PatchableGraph(model, x)
    assert isinstance(pg._graph_module, OpaqueGraphModule)
    assert {"scale", "offset", "linear", "unused"} <= set(dir(pg.graph))
    assert {"in_features", "out_features", "weight", "bias"} <= set(dir(pg.graph.unused))
    assert isinstance(pg._graph_module.unused, OpaqueGraphModule)  # never called: kept, with no shapes
    with pg.patch({"scale": AddPatch(value=1), "offset": ReplacePatch(value=0.0)}):
        torch.testing.assert_close(pg(x), model.linear(x) * 6)
    assert model.scale == 5 and model.offset == 2.0 and "scale" not in vars(model)


def test_unused_submodule_of_a_compiled_module():
    model, x = Skips(), torch.randn(2, 3)
    pg = PatchableGraph(model, x)
    assert isinstance(pg._graph_module.layers[1], UnusedModule)
    assert "layers_1" not in dir(pg.graph) and "layers_2" in dir(pg.graph)
    torch.testing.assert_close(pg(x), model(x))


def test_postprocessing_and_custom_graph_functions():
    torch.manual_seed(0)
    model, x = Aliased(), torch.randn(2, 3)
    seen: list[tuple[type, type]] = []
    PatchableGraph(model, ExtractionOptions(postprocessing_function=lambda gm, m: seen.append((type(gm), type(m)))),
                   x)
    assert seen and seen[0][1] is Aliased

    def identity_graph(module: nn.Module) -> fx.Graph:
        graph = fx.Graph()
        graph.output(graph.placeholder("input"))
        return graph

    pg = PatchableGraph(nn.Sequential(nn.Linear(3, 3), nn.ReLU()),
                        ExtractionOptions(custom_extraction_functions={nn.Linear: identity_graph}), x)
    torch.testing.assert_close(pg(x), torch.relu(x))
    assert pg.graph.sub_0.output._shape == x.shape


def test_config_generation_config_and_ignored_kwargs(tiny_llama, token_ids):
    pg = PatchableGraph(tiny_llama, token_ids, use_cache=False)
    assert pg.config.hidden_size == 64 and pg.config is not tiny_llama.config
    pg.generation_config.max_new_tokens = 2
    assert pg.generate(token_ids[:1], do_sample=False).shape[-1] == token_ids.shape[-1] + 2
    assert PatchableGraph(tiny_llama, ExtractionOptions(copy_transformers_generation_config=False), token_ids,
                          use_cache=False).config is None

    class IgnoresKwargs(nn.Module):
        def forward(self, x: torch.Tensor, **kwargs: object) -> torch.Tensor:
            return x * 2

    x = torch.ones(2)
    assert torch.equal(PatchableGraph(IgnoresKwargs(), x)(x, unused_flag=True), x * 2)


def test_subscript_and_shape_trees(tuple_module):
    pg = PatchableGraph(tuple_module, torch.randn(2, 3))
    assert pg.graph["linear_0.output"] is pg.graph.linear_0.output
    assert pg.graph["output|sub_1"]._path == "output|sub_1"
    assert pg.graph._shape.output.sub_1 == torch.Size([2, 2])
    assert pg.graph.output._shape.sub_0 == torch.Size([2, 2])
    assert "linear_0" in pg.graph and "_shape" not in pg.graph
    assert repr(pg.graph).startswith("<root>: CompiledGraphModule\n├─x: Tensor(2, 3)\n├─linear_0: CompiledGraphModule")


def test_save_and_load_without_pickle(tmp_path, tiny_llama, token_ids):
    pg = PatchableGraph(tiny_llama, token_ids, use_cache=False)
    with pytest.raises(ValueError, match=r"pg\.save\(path\)"):
        torch.save(pg, io.BytesIO())
    path = tmp_path / "graph.safetensors"
    pg.save(path)
    assert path.read_bytes()[8:].lstrip().startswith(b"{")  # a safetensors header, not a pickle
    from transformers import LlamaForCausalLM

    fresh = LlamaForCausalLM(tiny_llama.config).eval()
    loaded = PatchableGraph.load(path, fresh)
    torch.testing.assert_close(loaded(token_ids, use_cache=False).logits, pg(token_ids, use_cache=False).logits)
    with loaded.patch({"lm_head.output": ZeroPatch()}):
        assert torch.count_nonzero(loaded(token_ids, use_cache=False).logits) == 0
    buffer = io.BytesIO()
    pg.save(buffer, weights=False)
    buffer.seek(0)
    with pytest.raises(ValueError, match="fingerprint"):
        PatchableGraph.load(buffer, LlamaForCausalLM(tiny_llama.config))
    with pytest.raises(ValueError, match="saved for a"):
        PatchableGraph.load(path, nn.Linear(2, 2))
