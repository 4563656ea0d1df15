"""Dictionaries at every layer of the tiny Llama from one Lightning run (recipes.dictionary): per-layer skip
transcoders and a cross-layer transcoder (CLT) beat the mean predictor on held-out tokens, each layer spliced alone
scores as evaluate_dictionary scores it, the learning-rate schedule, the decoder bias's initialisations and the skip
term's least-squares initialisation."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer
from torch.utils.data import DataLoader

from gradpatch import PatchableGraph, testing
from gradpatch.capture import node_activations
from gradpatch.dictionaries import (CLTConfig, CrossLayerTranscoder, cross_layer_layers, evaluate_dictionary,
                                    evaluate_layers, load_clt, load_dictionary, normalized_mse,
                                    per_layer_dictionaries)
from recipes.dictionary import (CLTSpec, CrossLayerTranscoderModule, DictionaryModule, DictionarySpec, build_clt,
                                build_dictionaries, geometric_median, least_squares_skip, lr_factor)
from recipes.errors import RecipeConfigError

TRAIN = torch.randint(3, 100, (640, 12), generator=torch.Generator().manual_seed(0))  # 640 sequences of 12 tokens
HELD_OUT = [torch.randint(3, 100, (1, 12), generator=torch.Generator().manual_seed(seed)) for seed in (1, 2, 3)]


@pytest.fixture
def llama_graph() -> PatchableGraph:
    """A 2-layer Llama (d_model 64) initialised at std 0.1, so that its MLP outputs have norms ~3 per token (at the
    conftest's 0.02 they are ~0.02: a dictionary's first outputs would be noise 100 times their size)."""
    model = testing.tiny_llama(100, hidden=64, intermediate=128, init_std=0.1, max_position_embeddings=128,
                               pad_token_id=None, bos_token_id=1, eos_token_id=2)
    return PatchableGraph(model, testing.random_prompt_batch().clean, use_cache=False)


def _fit(module: DictionaryModule | CrossLayerTranscoderModule, root: Path) -> None:
    """One pass over :data:`TRAIN` in batches of 16 sequences (40 batches; the first fills the buffer)."""
    trainer = Trainer(max_epochs=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(root))
    trainer.fit(module, DataLoader(TRAIN, batch_size=16))


def test_a_spec_with_layers_gives_one_dictionary_per_layer_at_the_layouts_mlp(llama_graph) -> None:
    spec = DictionarySpec(node="mlp_input", kind="skip_transcoder", output_node="mlp", layers="all", k=4,
                          expansion_factor=2)
    dictionaries = build_dictionaries(llama_graph, spec, seed=0)
    assert [(d.config.input_node, d.config.output_node) for d in dictionaries] == [
        ("model.layers_0.mlp.x", "model.layers_0.mlp.output"), ("model.layers_1.mlp.x", "model.layers_1.mlp.output")]
    assert not torch.equal(dictionaries[0].W_enc, dictionaries[1].W_enc)  # seeded seed + i
    templated = DictionarySpec(node="model.layers_{layer}.mlp.x", kind="transcoder",
                               output_node="model.layers_{layer}.mlp.output", layers=[1])
    (one,) = build_dictionaries(llama_graph, templated, seed=0)
    assert one.config.output_node == "model.layers_1.mlp.output"
    with pytest.raises(RecipeConfigError, match=r"block indices in 0\.\.1"):
        build_dictionaries(llama_graph, DictionarySpec(node="mlp_input", layers=[2]), seed=0)
    with pytest.raises(RecipeConfigError, match="layout part"):
        build_dictionaries(llama_graph, DictionarySpec(node="no_such_part", layers="all"), seed=0)


@pytest.mark.parametrize("kind", ["sae", "skip_transcoder"])
def test_dictionaries_at_every_layer_train_in_one_run_below_the_mean_predictor(llama_graph, tmp_path: Path,
                                                                               kind: str) -> None:
    """SAEs at every residual stream, skip transcoders at every MLP: one run, one pass per batch. (The tiny Llama's
    SwiGLU MLPs are mostly quadratic in their input: least squares leaves an FVU of 0.83, so a transcoder's first
    40 steps gain less than an SAE's.)"""
    spec = DictionarySpec(node="resid" if kind == "sae" else "mlp_input", kind=kind,  # type: ignore[arg-type]
                          output_node=None if kind == "sae" else "mlp", layers="all", k=8, expansion_factor=2,
                          exclude_first_positions=1)
    dictionaries = build_dictionaries(llama_graph, spec, seed=0)
    module = DictionaryModule(llama_graph, dictionaries, buffer_rows=352, lr=1e-2, dead_after_tokens=2000,
                              lr_warmup_steps=4, lr_decay_fraction=0.2, b_dec_init="geometric_median",
                              ce_every_n_steps=0, density_every_n_steps=0)
    untrained = evaluate_layers(llama_graph, per_layer_dictionaries(dictionaries), HELD_OUT)
    _fit(module, tmp_path)
    trained = evaluate_layers(llama_graph, per_layer_dictionaries(dictionaries), HELD_OUT)
    for node, metrics in trained.layers.items():  # 1 is the mean predictor's FVU
        assert metrics.fvu < (0.75 if kind == "sae" else 1.0) and metrics.fvu < 0.7 * untrained.layers[node].fvu
        assert metrics.l0 <= 8
    assert trained.all_spliced.n_layers == 2 and trained.all_spliced.kl < untrained.all_spliced.kl
    for dictionary in dictionaries:  # one save_dictionary folder per written node
        saved = load_dictionary(tmp_path / "dictionary" / dictionary.config.output_node,
                                model=llama_graph.wrapped_model)
        assert torch.equal(saved.W_dec, dictionary.W_dec.detach())


def test_each_layer_spliced_alone_scores_as_evaluate_dictionary(llama_graph) -> None:
    dictionaries = build_dictionaries(llama_graph, DictionarySpec(node="mlp_input", kind="transcoder",
                                                                  output_node="mlp", layers="all", k=4,
                                                                  exclude_first_positions=2), seed=0)
    batches = [*HELD_OUT, torch.tensor([[5, 6]])]  # a document within the excluded positions: nothing spliced
    scores = evaluate_layers(llama_graph, per_layer_dictionaries(dictionaries), batches)
    for dictionary in dictionaries:
        alone = evaluate_dictionary(llama_graph, dictionary, batches)
        assert scores.layers[dictionary.config.output_node].to_dict() == pytest.approx(alone.to_dict())
    every = scores.all_spliced
    assert every.ce_loss_original == pytest.approx(alone.ce_loss_original)
    assert every.ce_loss_recovered == pytest.approx((every.ce_loss_zero_ablation - every.ce_loss_spliced)
                                                    / (every.ce_loss_zero_ablation - every.ce_loss_original))


@pytest.mark.parametrize("activation", ["jumprelu", "topk"])
def test_a_cross_layer_transcoder_trains_at_every_layer_and_saves_a_loadable_clt(llama_graph, tmp_path: Path,
                                                                                activation: str) -> None:
    spec = CLTSpec(activation=activation, k=8 if activation == "topk" else None, expansion_factor=2,
                   exclude_first_positions=1)
    clt = build_clt(llama_graph, spec, seed=0)
    assert clt.config.input_nodes == ["model.layers_0.mlp.x", "model.layers_1.mlp.x"]
    assert clt.config.output_nodes == ["model.layers_0.mlp.output", "model.layers_1.mlp.output"]
    threshold = clt.threshold.detach().clone() if activation == "jumprelu" else None
    module = CrossLayerTranscoderModule(llama_graph, clt, buffer_rows=352, lr=1e-2, sparsity_coefficient=1e-4,
                                        dead_after_tokens=2000, ce_every_n_steps=4, sparsity_warmup_steps=10)
    untrained = evaluate_layers(llama_graph, cross_layer_layers(clt), HELD_OUT)
    _fit(module, tmp_path)
    trained = evaluate_layers(llama_graph, cross_layer_layers(clt), HELD_OUT)
    for node, metrics in trained.layers.items():
        assert metrics.fvu < 1.0 and metrics.fvu < 0.7 * untrained.layers[node].fvu
    if threshold is not None:  # the tanh penalty's straight-through gradient moved θ
        assert not torch.equal(clt.threshold.detach(), threshold)
    else:
        assert max(m.l0 for m in trained.layers.values()) <= 8
    saved = load_clt(tmp_path / "dictionary", model=llama_graph.wrapped_model)
    assert saved.config.output_nodes == clt.config.output_nodes
    assert torch.equal(saved.W_dec[0], clt.W_dec[0].detach())


def test_a_clt_without_nodes_is_refused(llama_graph) -> None:
    with pytest.raises(RecipeConfigError, match="names no input_nodes"):
        CrossLayerTranscoderModule(llama_graph, CrossLayerTranscoder(CLTConfig("relu", 2, 64, 32)))


def test_the_learning_rate_warms_up_and_decays_to_zero() -> None:
    factors = [lr_factor(step, 100, warmup_steps=10, decay_fraction=0.2) for step in range(100)]
    assert factors[0] == pytest.approx(0.1) and factors[9] == 1.0 and factors[79] == 1.0
    assert factors[90] == pytest.approx(0.5) and factors[99] == pytest.approx(0.05)
    assert all(a >= b for a, b in zip(factors[9:], factors[10:]))
    assert lr_factor(5, 100) == 1.0


def test_the_geometric_median_resists_an_outlier() -> None:
    points = torch.cat([torch.randn(99, 3, generator=torch.Generator().manual_seed(0)) * 0.1,
                        torch.full((1, 3), 1000.0)])
    median = geometric_median(points)
    assert median.norm() < 0.1 < points.mean(0).norm()


def test_least_squares_skip_recovers_an_affine_map_and_refuses_mismatched_rows() -> None:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(300, 6, generator=generator)
    weight, bias = torch.randn(4, 6, generator=generator), torch.randn(4, generator=generator)
    fitted_weight, fitted_bias = least_squares_skip(x, x @ weight.T + bias, ridge=0.0)
    assert torch.allclose(fitted_weight, weight, atol=1e-4) and torch.allclose(fitted_bias, bias, atol=1e-4)
    few = least_squares_skip(x[:3], (x @ weight.T + bias)[:3], ridge=1e-2)  # fewer rows than inputs: the ridge solves
    assert few[0].shape == (4, 6) and bool(torch.isfinite(few[0]).all())
    with pytest.raises(ValueError, match="as many rows"):
        least_squares_skip(x, x[:10])


@pytest.mark.parametrize("skip_init", ["zero", "least_squares"])
def test_a_least_squares_skip_init_starts_each_skip_transcoder_at_the_regression(llama_graph, tmp_path: Path,
                                                                                  skip_init: str) -> None:
    """At a learning rate too small to move anything, what the run leaves is its initialisation: with
    ``least_squares`` the linear part alone (x W_skipᵀ + b_dec) already predicts held-out MLP outputs better than
    their mean; with ``zero``, W_skip stays ~0 (Adam moves it by ~lr per step) and the linear part is about the mean
predictor. (The fit reads the 2,000 buffered rows and the first step's 176: on 528 rows of 64 inputs it overfits
these random tokens, held-out FVU 1.04.)"""
    spec = DictionarySpec(node="mlp_input", kind="skip_transcoder", output_node="mlp", layers="all", k=4,
                          expansion_factor=2, exclude_first_positions=1)
    dictionaries = build_dictionaries(llama_graph, spec, seed=0)
    module = DictionaryModule(llama_graph, dictionaries, buffer_rows=2000, lr=1e-12, ce_every_n_steps=0,
                              density_every_n_steps=0, skip_init=skip_init)  # type: ignore[arg-type]
    _fit(module, tmp_path)
    held_out = torch.randint(3, 100, (40, 12), generator=torch.Generator().manual_seed(4))
    for dictionary in dictionaries:
        read, write = dictionary.config.input_node, dictionary.config.output_node
        x, y = (a[:, 1:].reshape(-1, a.shape[-1]) for a in node_activations(llama_graph, [read, write],
                                                                              held_out))
        linear = x @ dictionary.W_skip.detach().T + dictionary.b_dec.detach()
        if skip_init == "zero":
            assert float(dictionary.W_skip.detach().abs().max()) < 1e-9 < float(normalized_mse(linear, y)) - 0.95
        else:
            assert float(normalized_mse(linear, y)) < 0.95


def test_a_least_squares_skip_init_needs_a_decoder_bias_initialisation(llama_graph) -> None:
    dictionaries = build_dictionaries(llama_graph, DictionarySpec(node="mlp_input", kind="skip_transcoder",
                                                                  output_node="mlp", layers=[0], k=4), seed=0)
    with pytest.raises(RecipeConfigError, match="not 'keep'"):
        DictionaryModule(llama_graph, dictionaries, b_dec_init="keep", skip_init="least_squares")
    with pytest.raises(RecipeConfigError, match="skip_init must be"):
        DictionaryModule(llama_graph, dictionaries, skip_init="ones")  # type: ignore[arg-type]
