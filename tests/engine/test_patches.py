"""Patch semantics, ordering, slices and the errors raised for bad patch maps."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gradpatch import (
    AddPatch,
    CustomPatch,
    PatchableGraph,
    PatchShapeError,
    ProbePatch,
    RecordPatch,
    ReplacePatch,
    ZeroPatch,
)


@pytest.fixture
def linear_graph() -> tuple[PatchableGraph, nn.Linear, torch.Tensor]:
    torch.manual_seed(0)
    linear = nn.Linear(3, 4)
    x = torch.randn(2, 5, 3)
    return PatchableGraph(linear, x), linear, x


def test_each_patch_kind(linear_graph):
    pg, linear, x = linear_graph
    clean = linear(x)
    with pg.patch({"output": ZeroPatch()}):
        assert torch.count_nonzero(pg(x)) == 0
    with pg.patch({"output": AddPatch(value=torch.ones(4))}):
        torch.testing.assert_close(pg(x), clean + 1)
    with pg.patch({"output": ReplacePatch(value=torch.full((4,), 3.0))}):
        torch.testing.assert_close(pg(x), torch.full_like(clean, 3.0))
    with pg.patch({"output": CustomPatch(custom_op=lambda t: t * 2)}):
        torch.testing.assert_close(pg(x), clean * 2)
    probe, record = ProbePatch(), RecordPatch()
    with pg.patch({"input": probe, "linear": record}):
        pg(x)
        pg(x[:1])
    torch.testing.assert_close(probe.activation, x[:1])
    assert [tuple(a.shape) for a in record.activations] == [(2, 5, 4), (1, 5, 4)]
    torch.testing.assert_close(pg(x), clean)  # nothing stays patched after the block



def test_nested_blocks_of_probes_exit_in_any_state(linear_graph):
    """An inner block of probes leaves while the outer block's probes hold tensors: each block is removed by
    identity, so no patch's fields (tensors, which have no truth value) are compared."""
    pg, linear, x = linear_graph
    outer, inner = ProbePatch(), ProbePatch()
    with pg.patch({"output": outer}):
        pg(x)
        with pg.patch({"output": inner}):
            pg(x[:1])
        pg(x)
    torch.testing.assert_close(inner.activation, linear(x[:1]))
    torch.testing.assert_close(outer.activation, linear(x))
    torch.testing.assert_close(pg(x), linear(x))

def test_slices_apply_to_part_of_the_activation(linear_graph):
    pg, linear, x = linear_graph
    clean = linear(x)
    with pg.patch({"output": ZeroPatch(slice=(slice(None), 2))}):
        out = pg(x)
    assert torch.count_nonzero(out[:, 2]) == 0
    torch.testing.assert_close(out[:, 3], clean[:, 3])
    with pg.patch({"output": AddPatch(value=torch.ones(4), slice=(0, -1))}):
        out = pg(x)
    torch.testing.assert_close(out[0, -1], clean[0, -1] + 1)
    torch.testing.assert_close(out[1], clean[1])
    probe = ProbePatch(slice=(slice(None), -1))
    with pg.patch({"output": probe}):
        pg(x)
    torch.testing.assert_close(probe.activation, clean[:, -1].detach())


def test_patches_at_one_node_apply_in_order(linear_graph):
    pg, linear, x = linear_graph
    clean = linear(x)
    with pg.patch({"output": [AddPatch(value=torch.ones(4)), CustomPatch(custom_op=lambda t: t * 3)]}):
        torch.testing.assert_close(pg(x), (clean + 1) * 3)
    with pg.patch({"output": AddPatch(value=torch.ones(4))}):
        with pg.patch({"output": CustomPatch(custom_op=lambda t: t * 3)}):
            torch.testing.assert_close(pg(x), (clean + 1) * 3)
        torch.testing.assert_close(pg(x), clean + 1)


def test_weight_patch_leaves_the_weight_alone(linear_graph):
    pg, linear, x = linear_graph
    before = linear.weight.detach().clone()
    with pg.patch({"weight": ZeroPatch()}):
        torch.testing.assert_close(pg(x), linear.bias.expand(2, 5, 4))
    assert torch.equal(linear.weight, before)


def test_unknown_path_names_the_closest(tiny_llama, token_ids):
    pg = PatchableGraph(tiny_llama, token_ids, use_cache=False)
    with pytest.raises(KeyError, match="model.layers_0.mlp.down_proj.output"):
        with pg.patch({"model.layers_0.mlp.down_prj.output": ZeroPatch()}):
            pass


def test_non_leaf_and_invalid_type_raise_value_error(tiny_llama, token_ids, tuple_module):
    pg = PatchableGraph(tiny_llama, token_ids, use_cache=False)
    with pytest.raises(ValueError, match="names a graph"):
        with pg.patch({"model.layers_0.mlp": ZeroPatch()}):
            pass
    with pytest.raises(ValueError, match="must be a Patch"):
        with pg.patch({"lm_head.output": torch.zeros(3)}):
            pass
    tuple_graph = PatchableGraph(tuple_module, torch.randn(2, 3))
    with pytest.raises(ValueError, match=r"dig into it, e.g. 'output\|sub_0'"):
        with tuple_graph.patch({"output": ZeroPatch()}):
            pass


def test_wrong_shape_names_both_shapes(linear_graph):
    pg, linear, x = linear_graph
    with pytest.raises(PatchShapeError, match=r"shape \(3,\).*shape \(2, 5, 4\)"):
        with pg.patch({"output": AddPatch(value=torch.ones(3))}):
            pg(x)


def test_failure_inside_a_block_restores_everything(tiny_llama, token_ids):
    pg = PatchableGraph(tiny_llama, token_ids, use_cache=False)
    weights = {name: p.detach().clone() for name, p in tiny_llama.named_parameters()}
    clean = pg(token_ids, use_cache=False).logits
    with pytest.raises(RuntimeError, match="boom"):
        with pg.patch({"model.layers_0.mlp.down_proj.weight": AddPatch(value=torch.ones(64, 128)),
                       "lm_head.output": CustomPatch(custom_op=_boom)}):
            pg(token_ids, use_cache=False)
    for name, p in tiny_llama.named_parameters():
        assert torch.equal(p, weights[name]), name
    torch.testing.assert_close(pg(token_ids, use_cache=False).logits, clean)


def _boom(value: torch.Tensor) -> torch.Tensor:
    raise RuntimeError("boom")


def test_patched_intermediate_changes_downstream(tiny_llama, token_ids):
    pg = PatchableGraph(tiny_llama, token_ids, use_cache=False)
    clean = pg(token_ids, use_cache=False).logits
    with pg.patch({"model.layers_1.self_attn.attn_output": ZeroPatch()}):
        patched = pg(token_ids, use_cache=False).logits
    assert not torch.allclose(clean, patched)


def test_calls_of_another_kind_get_graphs_of_their_own(tiny_llama, token_ids):
    from gradpatch import InputSignatureError

    pg = PatchableGraph(tiny_llama, token_ids, use_cache=False)
    padded = torch.ones_like(token_ids)
    padded[0, :3] = 0
    with pytest.warns(UserWarning, match="new kind of call.*attention_mask"):
        out = pg(token_ids, attention_mask=padded, use_cache=False)
    torch.testing.assert_close(out.logits, tiny_llama(token_ids, attention_mask=padded, use_cache=False).logits)
    with pg.patch({"lm_head.output": ZeroPatch()}):  # patches checked on the example's graphs apply to these too
        assert torch.count_nonzero(pg(token_ids, attention_mask=padded, use_cache=False).logits) == 0
    linear = PatchableGraph(nn.Linear(3, 4), torch.randn(2, 3))
    with pytest.raises(InputSignatureError, match="does not fit"):
        linear(torch.randn(2, 3), no_such_argument=1)


def test_extraction_keeps_no_activations_for_a_backward_pass(tiny_llama, token_ids):
    pg = PatchableGraph(tiny_llama, token_ids, use_cache=False)
    mask = torch.ones_like(token_ids)
    saved: list[torch.Size] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t, lambda t: t):
        with torch.no_grad(), pytest.warns(UserWarning, match="new kind of call"):
            pg(token_ids, attention_mask=mask, use_cache=False)  # extracts in grad mode, throws its output away
    assert saved == []
    weight = tiny_llama.model.layers[0].mlp.down_proj.weight  # parameters are shared with the model
    patched = pg(token_ids, attention_mask=mask, use_cache=False).logits  # the new graphs still differentiate
    eager = tiny_llama(token_ids, attention_mask=mask, use_cache=False).logits
    torch.testing.assert_close(torch.autograd.grad(patched.square().sum(), weight)[0],
                               torch.autograd.grad(eager.square().sum(), weight)[0])
