"""Every intermediate tensor operation is a named node, reachable through NodePaths and the ``pg.graph`` tree."""

from __future__ import annotations

import pytest
import torch

from gradpatch import MultiplyInvokedModule, PatchableGraph, ZeroPatch
from gradpatch.errors import NodePathError


@pytest.fixture
def llama_graph(tiny_llama, token_ids) -> PatchableGraph:
    return PatchableGraph(tiny_llama, token_ids, use_cache=False)


def test_llama_attention_ops_are_nodes(llama_graph):
    attention = llama_graph.graph.model.layers_0.self_attn
    names = dir(attention)
    # Operations are named after the variables of transformers' code that hold them (as torch.compile names them).
    for expected in ("hidden_states", "q_proj", "k_proj", "v_proj", "o_proj", "query_states", "key_states",
                     "value_states", "q_embed", "k_embed", "cos", "sin", "attn_output", "output"):
        assert expected in names, expected
    rotary = [name for name in names if name.split("_")[0] in ("mul", "cat", "neg")]
    assert {"mul", "cat", "neg"} <= {name.split("_")[0] for name in rotary}
    assert attention.q_proj.output._shape == torch.Size([2, 7, 64])
    assert attention.k_embed._shape == torch.Size([2, 2, 7, 16])  # after rotary: what goes into a KV cache
    assert attention.attn_output._shape == torch.Size([2, 4, 7, 16])  # scaled_dot_product_attention's result
    assert "scaled_dot_product_attention" in attention.attn_output._code


def test_llama_mlp_ops_are_nodes(llama_graph):
    mlp = llama_graph.graph.model.layers_1.mlp
    assert {"x", "gate_proj", "act_fn", "up_proj", "mul", "down_proj", "output"} <= set(dir(mlp))
    assert "silu" in dir(mlp.act_fn)
    assert mlp.down_proj.input._shape == torch.Size([2, 7, 128])
    assert mlp.down_proj.output._shape == torch.Size([2, 7, 64])
    assert mlp.down_proj.weight._shape == torch.Size([64, 128])
    assert {"input", "weight", "linear", "output"} <= set(dir(mlp.down_proj))


def test_a_leaf_names_its_fx_node_and_graph_module(llama_graph):
    """op_name / fx_name / fx_node / graph_module: what freezing reads (the SDPA call's query argument, a get_attr
    weight of the graph module); a graph node has no fx node."""
    attention = llama_graph.graph.model.layers_0.self_attn
    leaf = attention.attn_output
    assert leaf.op_name.endswith("scaled_dot_product_attention")
    assert leaf.fx_node.name == leaf.fx_name and leaf.fx_node in leaf.graph_module.graph.nodes
    assert leaf.fx_node.args[0].name == attention.q_embed.fx_name  # the query after rotary
    assert attention.q_proj.output.op_name != leaf.op_name
    with pytest.raises(NodePathError, match="not computed by a torch.fx node"):
        attention.fx_node
    assert attention.graph_module is None and attention.op_name == "" and attention.fx_name == ""


def test_tree_repr_code_and_paths(llama_graph):
    text = repr(llama_graph.graph.model.layers_0.mlp)
    assert text.startswith("mlp: CompiledGraphModule\n")
    assert "down_proj: CompiledGraphModule\n" in text and "linear: Tensor(2, 7, 64)" in text
    assert "def forward" in llama_graph.graph.model.layers_0.mlp._code
    assert "linear(" in llama_graph.graph.model.layers_0.mlp.down_proj.linear._code
    assert llama_graph.graph.model.layers_0.mlp.down_proj.output._path == "model.layers_0.mlp.down_proj.output"


def test_tuple_output_module_invocations(tuple_module):
    x = torch.randn(4, 3)
    pg = PatchableGraph(tuple_module, x)
    assert isinstance(pg._graph_module.linear, MultiplyInvokedModule)
    assert {"linear_0", "linear_1", "output"} <= set(dir(pg.graph))
    assert set(dir(pg.graph.output)) == {"sub_0", "sub_1", "_code", "_shape"}
    expected_0, expected_1 = tuple_module(x)
    with pg.patch({"linear_0.output": ZeroPatch()}):
        first, second = pg(x)
    assert torch.count_nonzero(first) == 0
    torch.testing.assert_close(second, expected_1)
    with pg.patch({"output|sub_1": ZeroPatch()}):
        first, second = pg(x)
    torch.testing.assert_close(first, expected_0)
    assert torch.count_nonzero(second) == 0


def test_dict_output_digs(mlp):
    pg = PatchableGraph(mlp, torch.randn(3, 4))
    assert set(dir(pg.graph.output)) == {"out", "hidden", "_code", "_shape"}
    with pg.patch({"output|hidden": ZeroPatch()}):
        result = pg(torch.randn(3, 4))
    assert torch.count_nonzero(result["hidden"]) == 0
    assert torch.count_nonzero(result["out"]) > 0


def test_unknown_child_attribute_suggests(llama_graph):
    with pytest.raises(AttributeError, match="did you mean"):
        llama_graph.graph.model.layers_0.mlpp


def test_original_module(llama_graph, tiny_llama):
    assert llama_graph.original_module("model.layers_1.mlp.down_proj") is tiny_llama.model.layers[1].mlp.down_proj
    with pytest.raises(ValueError, match="leaf"):
        llama_graph.original_module("model.layers_1.mlp.down_proj.output")


def test_public_node_lookup(llama_graph):
    """pg.node, NodeData.is_graph / name / tensor_shape, pg.node_paths and pg.draw: what editors and recipes use."""
    from gradpatch import NodePathError

    mlp = llama_graph.node("model.layers_1.mlp")
    assert mlp.is_graph and mlp.name == "mlp" and mlp.tensor_shape is None
    down = llama_graph.node("model.layers_1.mlp.down_proj.output")
    assert not down.is_graph and down.name == "output" and down.tensor_shape == torch.Size([2, 7, 64])
    attention_output = llama_graph.node("model.layers_0.self_attn.output")
    assert attention_output.tensor_shape is None  # a tuple: dig into it
    assert llama_graph.node("model.layers_0.self_attn.output|sub_0").tensor_shape == torch.Size([2, 7, 64])
    paths = llama_graph.node_paths()
    assert "model.layers_1.mlp.down_proj.output" in paths and "model.layers_0.self_attn.output|sub_0" in paths
    assert len(paths) == len(set(paths))
    with pytest.raises(NodePathError, match="model.layers_1.mlp"):
        llama_graph.node("model.layers_1.mlpp")
    shallow = llama_graph.draw("model.layers_1.mlp", depth=1)
    assert shallow.splitlines()[0].startswith("mlp") and "down_proj" in shallow
    assert "weight" not in shallow and "weight" in llama_graph.draw("model.layers_1.mlp")
    assert llama_graph.draw() == repr(llama_graph.graph)
