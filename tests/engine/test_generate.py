"""pg.generate runs transformers generation through the graph with the model's KV cache, patches active."""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import DynamicCache, StaticCache

from gradpatch import AddPatch, CustomPatch, PatchableGraph, PatchShapeError, RecordPatch, ReplacePatch, ZeroPatch
from gradpatch.generation import cache_argument
from gradpatch.positions import Tokens

GREEDY = {"do_sample": False, "pad_token_id": 0}
SCORED = {**GREEDY, "max_new_tokens": 5, "output_logits": True, "return_dict_in_generate": True}

# One op-level node of each kind per model: attention internals, MLP activation, residual stream.
NODES = {
    "tiny_llama": {"attention": "model.layers_0.self_attn.attn_output", "keys": "model.layers_0.self_attn.k_embed",
                   "mlp": "model.layers_0.mlp.act_fn.output", "residual": "model.layers_1.input_layernorm.output"},
    "tiny_gpt2": {"attention": "transformer.h_0.attn.attn_output", "keys": "transformer.h_0.attn.key_states_1",
                  "mlp": "transformer.h_0.mlp.act.output", "residual": "transformer.h_1.ln_1.output"},
}


@pytest.fixture(params=["tiny_llama", "tiny_gpt2"])
def setup(request, token_ids):
    model = request.getfixturevalue(request.param)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield request.param, model, PatchableGraph(model, token_ids, use_cache=False), token_ids


def _max_difference(first, second) -> float:
    return max(float((a - b).abs().max()) for a, b in zip(first.logits, second.logits))


def test_cached_generation_equals_model_generate(setup):
    _, model, pg, ids = setup
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # a left-padded batch
    for kwargs in ({}, {"attention_mask": mask}, {"cache_implementation": "static"}):
        expected = model.generate(ids, max_new_tokens=6, **GREEDY, **kwargs)
        assert torch.equal(pg.generate(ids, max_new_tokens=6, **GREEDY, **kwargs), expected), kwargs
    assert torch.equal(pg.generate(ids, max_new_tokens=6, use_cache=False, **GREEDY),
                       model.generate(ids, max_new_tokens=6, **GREEDY))
    assert "forward" not in vars(model)  # the original model is left as it was


@pytest.mark.parametrize("where", ["attention", "keys", "mlp", "residual"])
def test_position_independent_patches_equal_the_recompute(setup, where):
    name, _, pg, ids = setup
    node = NODES[name][where]
    size = pg.node(node)._shape[-1]
    value = torch.randn(size, generator=torch.Generator().manual_seed(3))
    unpatched = pg.generate(ids, **SCORED)
    changes = []
    for patch in (ZeroPatch(), AddPatch(value=value), ReplacePatch(value=value),
                  CustomPatch(custom_op=lambda t: t * 1.5)):
        with pg.patch({node: patch}):
            cached, recomputed = pg.generate(ids, **SCORED), pg.generate(ids, use_cache=False, **SCORED)
        assert torch.equal(cached.sequences, recomputed.sequences), (node, patch)
        assert _max_difference(cached, recomputed) <= 1e-5, (node, patch)
        changes.append(_max_difference(cached, unpatched))
    assert min(changes[0], changes[2]) > 1e-3  # Zero and Replace change the generation (adding one vector to
    # every key does not: attention scores shift alike)


def test_slices_index_the_current_forward_pass(setup):
    name, _, pg, ids = setup
    node = NODES[name]["residual"]
    value = torch.randn(pg.node(node)._shape[-1], generator=torch.Generator().manual_seed(4)) * 2
    prompt = ids.shape[1]
    with pg.patch({node: [AddPatch(value=value, slice=(slice(None), -1)), record := RecordPatch()]}):
        cached = pg.generate(ids, **SCORED)
    # The last token of each forward pass: the last prompt token, then each new token once (kept in the cache).
    with pg.patch({node: AddPatch(value=value, slice=Tokens(range(prompt - 1, prompt + 5)))}):
        recomputed = pg.generate(ids, use_cache=False, **SCORED)
    assert torch.equal(cached.sequences, recomputed.sequences) and _max_difference(cached, recomputed) <= 1e-5
    assert [tuple(a.shape[:2]) for a in record.activations] == [(2, prompt)] + [(2, 1)] * 4  # one per forward pass


@pytest.mark.parametrize("select", ["prompt", "generated"])
def test_prompt_and_generated_tokens_agree_cached_or_not(setup, select):
    name, _, pg, ids = setup
    node = NODES[name]["mlp"]
    value = torch.randn(pg.node(node)._shape[-1], generator=torch.Generator().manual_seed(5))
    with pg.patch({node: AddPatch(value=value, slice=Tokens(select))}):
        cached, recomputed = pg.generate(ids, **SCORED), pg.generate(ids, use_cache=False, **SCORED)
    assert torch.equal(cached.sequences, recomputed.sequences) and _max_difference(cached, recomputed) <= 1e-5


def test_a_value_shaped_for_the_prompt_fails_at_the_first_step(setup):
    name, model, pg, ids = setup
    node = NODES[name]["mlp"]
    cache = DynamicCache(config=model.config)
    bad = torch.zeros(ids.shape[1], pg.node(node)._shape[-1])
    with pytest.raises(PatchShapeError, match=r"generation step 1 .*shape \(7, \d+\).*\(2, 1, \d+\)"):
        with pg.patch({node: AddPatch(value=bad)}):
            pg.generate(ids, max_new_tokens=3, **{cache_argument(model): cache}, **GREEDY)
    assert cache.get_seq_length() == ids.shape[1]  # the failed step left nothing in the caller's cache
    assert torch.equal(pg.generate(ids, max_new_tokens=3, **GREEDY), model.generate(ids, max_new_tokens=3, **GREEDY))


def test_a_failed_step_rewinds_a_static_cache_to_the_prompt(setup):
    name, model, pg, ids = setup
    node = NODES[name]["mlp"]
    cache = StaticCache(config=model.config, max_cache_len=ids.shape[1] + 4)
    bad = torch.zeros(ids.shape[1], pg.node(node)._shape[-1])
    with pytest.raises(PatchShapeError, match="generation step 1"):
        with pg.patch({node: AddPatch(value=bad)}):
            pg.generate(ids, max_new_tokens=3, **{cache_argument(model): cache}, **GREEDY)
    reference = StaticCache(config=model.config, max_cache_len=ids.shape[1] + 4)  # the prompt's prefill alone
    with torch.no_grad():
        model(ids, use_cache=True, **{cache_argument(model): reference})
    for got, want in zip(cache.layers, reference.layers, strict=True):
        assert int(got.get_seq_length()) == int(want.get_seq_length()) == ids.shape[1]
        # the prompt's positions; later ones are stale or zero, and the next step writes over them
        torch.testing.assert_close(got.keys[:, :, :ids.shape[1]], want.keys[:, :, :ids.shape[1]])
        torch.testing.assert_close(got.values[:, :, :ids.shape[1]], want.values[:, :, :ids.shape[1]])
    with torch.no_grad():  # and the next step from either cache is the same
        steps = [model(ids[:, -1:], use_cache=True, **{cache_argument(model): c}).logits for c in (cache, reference)]
    torch.testing.assert_close(steps[0], steps[1])
