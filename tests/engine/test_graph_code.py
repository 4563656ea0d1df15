"""``pg.graph._code`` shows a compiled graph's code under the forward's own signature (issue 38; graphpatch's
``test_node_path_code``)."""

import pytest
import torch
from torch import nn

from gradpatch import ExtractionOptions, PatchableGraph

COMPILED = ExtractionOptions(error_on_compilation_failure=True)


class Unannotated(nn.Module):
    """graphpatch's DeeplyNestedOutputModule's signature: ``forward(self, x)``, and a child with defaults."""

    class Child(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(3, 3)

        def forward(self, inputs, extra=None, scale=2):
            return self.linear(inputs + extra) * scale

    def __init__(self) -> None:
        super().__init__()
        self.child = self.Child()

    def forward(self, x):
        return self.child(x, extra=x * 2)


class Annotated(nn.Module):
    """Annotations, ``*args``, a keyword-only constant, ``**kwargs`` and a return annotation."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor, *foos: torch.Tensor, blah: int = 3, **bars: torch.Tensor) -> torch.Tensor:
        result = self.linear(x)
        for foo in foos:
            result = result + foo
        return result * blah + sum(bars.values())


class Markers(nn.Module):
    """A positional-only input, a bare ``*`` before keyword-only ones, and an annotation written as a string."""

    def forward(self, x, /, y: "torch.Tensor", *, scale: float = 0.5):
        return (x + y) * scale


def _header(pg: PatchableGraph, path: str = "") -> str:
    node = pg.graph[path] if path else pg.graph
    return node._code.splitlines()[0]


def test_an_unannotated_tensor_input_is_shown_as_graphpatch_showed_it():
    x = torch.ones(2, 3)
    pg = PatchableGraph(Unannotated(), COMPILED, x)
    assert pg.graph._code.startswith("def forward(self, x : torch.Tensor):\n")  # no blank lines before it
    assert not pg.graph._code.endswith(("\n", " ")) and pg.graph.code == pg.graph._code
    assert _header(pg, "child") == "def forward(self, inputs : torch.Tensor, extra : torch.Tensor = None, scale = 2):"


def test_only_the_def_line_changes():
    x, model = torch.ones(2, 3), Unannotated()
    pg = PatchableGraph(model, COMPILED, x)
    generated = pg._graph_module.child.code.strip("\n").rstrip().splitlines()
    shown = pg.graph.child._code.splitlines()
    assert generated[0].startswith("def forward(self, inputs = None")  # what runs: every input defaults to None
    assert shown[1:] == generated[1:] and len(shown) > 2
    torch.testing.assert_close(pg(x), model(x))  # and it still runs as before


def test_annotations_varargs_keyword_only_constants_and_the_return_annotation():
    ones = torch.ones(2, 3)
    pg = PatchableGraph(Annotated(), COMPILED, ones, ones, blah=4, bar=ones)
    assert _header(pg) == ("def forward(self, x : torch.Tensor, *foos : torch.Tensor, blah : int = 3, "
                           "**bars : torch.Tensor) -> torch.Tensor:")


def test_positional_only_and_keyword_only_markers_and_string_annotations():
    ones = torch.ones(2, 3)
    pg = PatchableGraph(Markers(), COMPILED, ones, ones, scale=0.25)
    assert _header(pg) == "def forward(self, x : torch.Tensor, /, y : torch.Tensor, *, scale : float = 0.5):"


@pytest.mark.parametrize("path, header", [
    ("model.layers_0.mlp", "def forward(self, x : torch.Tensor):"),
    ("model.norm", "def forward(self, hidden_states : torch.Tensor) -> torch.Tensor:"),
])
def test_transformers_signatures(tiny_llama, token_ids, path, header):
    pg = PatchableGraph(tiny_llama, token_ids, use_cache=False)
    assert _header(pg, path) == header
    attention = _header(pg, "model.layers_0.self_attn")
    assert "cache : transformers.cache_utils.Cache | None = None" in attention
    assert attention.endswith("**kwargs : Unpack[transformers.utils.generic.TransformersKwargs]) -> "
                              "tuple[torch.Tensor, torch.Tensor]:")
