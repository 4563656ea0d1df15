"""benchmarks/dictionaries/transcoder_tuning.py scores its trials as the library does: its development-text scores
(FVU and CE loss recovered with each layer spliced alone at positions 2..) equal evaluate_layers' on the same
documents (the tiny Llama; its CE scoring failed on every document until it returned the slice it patched)."""

from __future__ import annotations

import pytest
import torch

from benchmarks.dictionaries.transcoder_tuning import EXCLUDED, dev_scores
from gradpatch import PatchableGraph, testing
from gradpatch.dictionaries import evaluate_layers, per_layer_dictionaries
from recipes.dictionary import DictionarySpec, build_dictionaries
from recipes.dictionary.fit import layer_nodes


def test_development_scores_equal_evaluate_layers(tmp_path) -> None:
    model = testing.tiny_llama(100, hidden=64, intermediate=128, init_std=0.1, max_position_embeddings=128,
                               pad_token_id=None, bos_token_id=1, eos_token_id=2)
    pg = PatchableGraph(model, testing.random_prompt_batch().clean, use_cache=False)
    spec = DictionarySpec(node="mlp_input", kind="skip_transcoder", output_node="mlp", layers="all", k=4,
                          expansion_factor=2, exclude_first_positions=EXCLUDED)
    transcoders = build_dictionaries(pg, spec, seed=0)
    documents = [torch.randint(3, 100, (1, n), generator=torch.Generator().manual_seed(n)) for n in (12, 9, 16)]
    inputs, outputs = layer_nodes(pg, "mlp_input", [0, 1]), layer_nodes(pg, "mlp", [0, 1])
    with torch.no_grad():
        scores = dev_scores(pg, transcoders, inputs, outputs, documents, tmp_path / "base.json")
        reference = evaluate_layers(pg, per_layer_dictionaries(transcoders), documents)
    assert list(scores) == ["0", "1"]
    for one, metrics in zip(scores.values(), reference.layers.values()):
        assert one["fvu"] == pytest.approx(metrics.fvu, rel=1e-4, abs=1e-4)  # rounded to 4 places
        assert one["ce_recovered"] == pytest.approx(metrics.ce_loss_recovered, rel=1e-4, abs=1e-4)
        assert abs(one["ce_recovered"] - 1) > 1e-2  # random transcoders: the splice changed the CE
    assert (tmp_path / "base.json").is_file()  # the model's and the zero-ablated CEs, kept for the next trial
