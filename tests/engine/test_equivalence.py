"""Outside a patch block a PatchableGraph computes what the wrapped model computes."""

from __future__ import annotations

import warnings

import pytest
import torch

from gradpatch import PatchableGraph

OTHER_SHAPES = [(1, 3), (3, 11), (1, 1), (2, 7), (4, 2)]


@pytest.mark.parametrize("model_name", ["tiny_llama", "tiny_gpt2"])
def test_transformers_outputs_match_on_other_shapes(model_name, token_ids, request):
    model = request.getfixturevalue(model_name)
    pg = PatchableGraph(model, token_ids, use_cache=False)
    for batch, seq in OTHER_SHAPES:
        ids = torch.randint(0, 100, (batch, seq), generator=torch.Generator().manual_seed(batch * 100 + seq))
        with torch.no_grad():
            expected = model(ids, use_cache=False).logits
            actual = pg(ids, use_cache=False).logits
        torch.testing.assert_close(actual, expected)


def test_batch_one_example_serves_larger_batches(tiny_llama):
    example = torch.randint(0, 100, (1, 5))
    pg = PatchableGraph(tiny_llama, example, use_cache=False)
    ids = torch.randint(0, 100, (3, 9))
    with pytest.warns(UserWarning, match="extracting graphs for input sizes"):
        actual = pg(ids, use_cache=False).logits
    torch.testing.assert_close(actual, tiny_llama(ids, use_cache=False).logits)


def test_attention_mask_as_input(tiny_llama, token_ids):
    mask = torch.ones_like(token_ids)
    pg = PatchableGraph(tiny_llama, token_ids, attention_mask=mask, use_cache=False)
    ids = torch.randint(0, 100, (3, 6))
    padded = torch.ones_like(ids)
    padded[0, :2] = 0
    torch.testing.assert_close(pg(ids, attention_mask=padded, use_cache=False).logits,
                               tiny_llama(ids, attention_mask=padded, use_cache=False).logits)


def test_gradients_match_the_original(tiny_llama, token_ids):
    pg = PatchableGraph(tiny_llama, token_ids, use_cache=False)
    ids = torch.randint(0, 100, (3, 5))
    grads = []
    for run in (tiny_llama, pg):
        tiny_llama.zero_grad()
        run(ids, use_cache=False).logits.logsumexp(-1).sum().backward()
        grads.append({name: p.grad.clone() for name, p in tiny_llama.named_parameters()})
    tiny_llama.zero_grad()
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, msg=name)


def test_plain_module_with_dict_output(mlp):
    x = torch.randn(5, 4)
    pg = PatchableGraph(mlp, x)
    y = torch.randn(1, 4)
    for key in ("out", "hidden"):
        torch.testing.assert_close(pg(y)[key], mlp(y)[key])


def test_parameters_are_shared(tiny_llama, token_ids):
    pg = PatchableGraph(tiny_llama, token_ids, use_cache=False)
    originals = {id(p) for p in tiny_llama.parameters()}
    assert {id(p) for p in pg.parameters()} == originals


def test_dtype_conversion_reaches_graphs_and_example(tiny_llama, token_ids):
    pg = PatchableGraph(tiny_llama, token_ids, use_cache=False)
    pg.double()
    assert tiny_llama.lm_head.weight.dtype == torch.float64
    logits = pg(token_ids, use_cache=False).logits
    assert logits.dtype == torch.float64
    torch.testing.assert_close(logits, tiny_llama(token_ids, use_cache=False).logits)


def test_an_older_transformers_than_the_tested_ones_is_named(tiny_llama, token_ids, monkeypatch):
    import transformers

    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # the installed release warns nothing
        PatchableGraph(tiny_llama, token_ids, use_cache=False)
    monkeypatch.setattr(transformers, "__version__", "4.57.6")
    with pytest.warns(UserWarning, match=r"transformers >= 5\.12, and 4\.57\.6 is installed.*pip install"):
        PatchableGraph(tiny_llama, token_ids, use_cache=False)
