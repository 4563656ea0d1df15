"""Defects of issue 61, each pinned: ``metrics.json`` has one schema whatever the number of dictionaries and carries
SAELens's metric names; ``DictionaryModule`` offers sparsify's AuxK normalisation; a bad feature index raises one
error type from both circuit interventions."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from gradpatch import PatchableGraph, testing
from gradpatch.circuits import CircuitError, ReplacementModel
from gradpatch.circuits import FeatureEdit, FeatureIndexError, intervene, intervene_direct
from gradpatch.dictionaries import (SAELENS_NAMES, DictionaryConfigError, SkipTranscoder, SparseAutoencoder,
                                    Transcoder, auxk_loss)
from recipes.dictionary import DictionaryModule, write_dictionary_metrics
from recipes.errors import RecipeConfigError

DOCUMENTS = [torch.randint(3, 100, (7,), generator=torch.Generator().manual_seed(seed)).tolist() for seed in (1, 2)]


def test_metrics_json_has_one_schema_for_one_or_several_dictionaries(llama_graph, tmp_path: Path) -> None:
    """``{"dictionaries": {written node: metrics}}`` for one dictionary as for two; each metrics object has our
    names and SAELens's (``ce_loss_with_sae`` ...), holding the same numbers."""
    sae = SparseAutoencoder(64, 128, "topk", k=4, node="model.layers_0.output")
    transcoder = Transcoder(64, 96, activation="relu", input_node="model.layers_1.mlp.x",
                            output_node="model.layers_1.mlp.output")
    write_dictionary_metrics(llama_graph, sae, DOCUMENTS, tmp_path / "one")
    write_dictionary_metrics(llama_graph, [sae, transcoder], DOCUMENTS, tmp_path / "two")
    one = json.loads((tmp_path / "one" / "metrics.json").read_text())["dictionaries"]
    two = json.loads((tmp_path / "two" / "metrics.json").read_text())["dictionaries"]
    assert list(one) == ["model.layers_0.output"]
    assert list(two) == ["model.layers_0.output", "model.layers_1.mlp.output"]
    assert one["model.layers_0.output"] == two["model.layers_0.output"]  # each dictionary evaluated alone
    for scores in (*one.values(), *two.values()):
        assert set(scores) == set(two["model.layers_1.mlp.output"]) and scores["n_tokens"] == 14
        for saelens, ours in SAELENS_NAMES.items():
            assert scores[saelens] == scores[ours]
    assert set(SAELENS_NAMES) == {"ce_loss_with_sae", "ce_loss_without_sae", "ce_loss_with_ablation", "ce_loss_score",
                                  "kl_div_with_sae"}


def test_dictionary_module_offers_sparsifys_auxk_normalisation(llama_graph) -> None:
    """``auxk_normalization="target"`` divides AuxK by the target's variance (sparsify), ``"residual"`` (the
    default) by the residual's; anything else is refused naming both."""
    rows = torch.randn(32, 64, generator=torch.Generator().manual_seed(0))
    terms = {}
    for normalization in ("residual", "target"):
        sae = SparseAutoencoder(64, 128, "topk", k=4, node="model.layers_0.output",
                                generator=torch.Generator().manual_seed(0))
        module = DictionaryModule(llama_graph, sae, buffer_rows=32, dead_after_tokens=1,
                                  auxk_normalization=normalization)
        module.tokens_since_fired.fill_(2)  # every latent dead: AuxK is active
        terms[normalization] = module.local_terms(0, rows, rows)
        with torch.no_grad():
            h = sae.pre_activations(rows)
            residual = rows - sae.output(rows, sae.activate(h))
            dead = ~(sae.activate(h) > 0).any(0)
            expected = auxk_loss(h, residual, sae.W_dec, dead, 32, target=rows if normalization == "target" else None)
        assert torch.allclose(terms[normalization]["auxk"], expected)
    assert not torch.allclose(terms["residual"]["auxk"], terms["target"]["auxk"])
    with pytest.raises(RecipeConfigError, match="'residual' or 'target'"):
        DictionaryModule(llama_graph, SparseAutoencoder(64, 128, "topk", k=4, node="model.layers_0.output"),
                         auxk_normalization="variance")  # type: ignore[arg-type]


def test_a_bad_feature_index_raises_one_error_type_from_both_interventions() -> None:
    """The same out-of-range feature: :class:`FeatureIndexError` (a ``CircuitError`` and a ``DictionaryConfigError``)
    from ``intervene`` and ``intervene_direct``, naming the valid range."""
    model = testing.tiny_llama(100, hidden=64, intermediate=128, init_std=0.02, max_position_embeddings=128,
                               pad_token_id=None, bos_token_id=1, eos_token_id=2)
    prompt = torch.randint(0, 100, (1, 5), generator=torch.Generator().manual_seed(3))
    pg = PatchableGraph(model, prompt, use_cache=False)
    transcoders = {layer: SkipTranscoder(64, 64, activation="relu", input_node=f"model.layers_{layer}.mlp.x",
                                         output_node=f"model.layers_{layer}.mlp.output") for layer in range(2)}
    replacement = ReplacementModel(pg, transcoders, prompt)
    for feature in (64, -1):
        edit = FeatureEdit(layer=1, position=2, feature=feature)
        errors = []
        for run in (lambda: intervene(pg, transcoders, prompt, [edit]), lambda: intervene_direct(replacement, [edit])):
            with pytest.raises(FeatureIndexError, match=r"feature -?\d+ is outside 0\.\.63") as caught:
                run()
            errors.append(caught.value)
        assert all(isinstance(error, CircuitError) and isinstance(error, DictionaryConfigError) for error in errors)
        assert str(errors[0]) == str(errors[1])
