"""Interventions are saved as safetensors + JSON and load back into a fresh PatchableGraph."""

from __future__ import annotations

import json

import pytest
import torch

from gradpatch import AddPatch, CustomPatch, Intervention, PatchableGraph, ReplacePatch, ZeroPatch, model_fingerprint


def test_round_trip_gives_the_same_outputs(tiny_llama, token_ids, tmp_path):
    pg = PatchableGraph(tiny_llama, token_ids, use_cache=False)
    intervention = Intervention({
        "model.layers_0.output": AddPatch(value=torch.randn(64), slice=(slice(None), slice(1, None))),
        "model.layers_1.mlp.down_proj.input": [ZeroPatch(slice=(Ellipsis, 3)),
                                               ReplacePatch(value=torch.randn(128), slice=(0, -1))],
    })
    with pg.patch(intervention):
        expected = pg(token_ids, use_cache=False).logits
    folder = intervention.save(tmp_path / "steer", model=tiny_llama)
    document = json.loads((folder / "intervention.json").read_text())
    assert document["model_fingerprint"] == model_fingerprint(tiny_llama)
    assert [record["kind"] for record in document["patches"]] == ["AddPatch", "ZeroPatch", "ReplacePatch"]
    assert sorted(p.name for p in folder.iterdir()) == ["intervention.json", "intervention.safetensors"]

    fresh = PatchableGraph(tiny_llama, token_ids, use_cache=False)
    loaded = Intervention.load(folder, graph=fresh, model=tiny_llama)
    with fresh.patch(loaded):
        torch.testing.assert_close(fresh(token_ids, use_cache=False).logits, expected)


def test_load_into_a_graph_without_the_paths(tiny_llama, tiny_gpt2, token_ids, tmp_path):
    folder = Intervention({"model.layers_0.mlp.down_proj.output": AddPatch(value=torch.zeros(64))}).save(tmp_path)
    gpt2_graph = PatchableGraph(tiny_gpt2, token_ids, use_cache=False)
    with pytest.raises(KeyError, match="model.layers_0.mlp.down_proj.output"):
        Intervention.load(folder, graph=gpt2_graph)


def test_custom_patch_cannot_be_saved(tmp_path):
    intervention = Intervention({"output": CustomPatch(custom_op=torch.neg)})
    with pytest.raises(ValueError, match="without pickle"):
        intervention.save(tmp_path)
