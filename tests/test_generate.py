"""pg.generate runs transformers generation through the graph, with patches active."""

from __future__ import annotations

import pytest
import torch

from gradpatch import CustomPatch, PatchableGraph


@pytest.mark.parametrize("model_name", ["tiny_llama", "tiny_gpt2"])
def test_generate_matches_and_patches_apply(model_name, token_ids, request):
    model = request.getfixturevalue(model_name)
    pg = PatchableGraph(model, token_ids, use_cache=False)
    prompt = token_ids[:1]
    expected = model.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(pg.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0), expected)
    banned = int(expected[0, prompt.shape[1]])

    def ban(logits: torch.Tensor) -> torch.Tensor:
        return logits.index_fill(-1, torch.tensor([banned]), float("-inf"))

    with pg.patch({"lm_head.output": CustomPatch(custom_op=ban)}):
        patched = pg.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert banned not in patched[0, prompt.shape[1]:].tolist()
    assert torch.equal(pg.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0), expected)
    assert "forward" not in vars(model)  # the original model is left as it was


def test_generate_reuses_the_example_graphs(tiny_llama, token_ids, recwarn):
    pg = PatchableGraph(tiny_llama, token_ids, use_cache=False)
    pg.generate(token_ids, max_new_tokens=2, do_sample=False, pad_token_id=0)
    assert not [w for w in recwarn if "extracting graphs" in str(w.message)]
