"""The embedded real model, SmolLM2-135M-Instruct (slow: ~30 s to load)."""

from __future__ import annotations

import pytest
import torch

from gradpatch import PatchableGraph, ProbePatch, ZeroPatch

pytestmark = pytest.mark.slow

PROMPT = "The Eiffel Tower is located in the city of"


def test_smollm2_graph_matches_and_patches(smollm2):
    model, tokenizer = smollm2
    ids = tokenizer([PROMPT, PROMPT], return_tensors="pt").input_ids
    pg = PatchableGraph(model, ids, use_cache=False)
    other = tokenizer(["Rome is the capital of", "Paris is in France and"], return_tensors="pt").input_ids
    with torch.no_grad():
        torch.testing.assert_close(pg(other, use_cache=False).logits, model(other, use_cache=False).logits)
        single = ids[:1]
        torch.testing.assert_close(pg(single, use_cache=False).logits, model(single, use_cache=False).logits)
        assert tokenizer.decode(pg(single, use_cache=False).logits[0, -1].argmax()) == " Paris"
        attention = pg.graph.model.layers_3.self_attn
        assert {"attn_output", "q_embed", "k_embed", "cat"} <= set(dir(attention))
        probe = ProbePatch()
        with pg.patch({"model.layers_3.mlp.down_proj.input": probe,
                       "model.layers_29.output": ZeroPatch(slice=(slice(None), -1))}):
            patched = pg(single, use_cache=False).logits
        assert probe.activation.shape == (1, ids.shape[1], 1536)
        assert tokenizer.decode(patched[0, -1].argmax()) != " Paris"
