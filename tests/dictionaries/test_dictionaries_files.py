"""Dictionary files: our safetensors + JSON round trip, SAELens's, sparsify's and circuit-tracer's layouts (files
written here as those libraries write them, checked against their equations written out), export and reload, and
every bad file refused with a clear error before anything is built."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import save_file

from gradpatch import GradpatchError, model_fingerprint, testing
from gradpatch.errors import FingerprintMismatchError
from gradpatch.dictionaries import (DictionaryConfigError, DictionaryLoadError, SkipTranscoder, SparseAutoencoder,
                                    Transcoder, export_circuit_tracer, export_saelens, load_circuit_tracer,
                                    load_dictionary, load_saelens, load_sparsify, save_dictionary)

D, M = 6, 16
X = torch.randn(4, 3, D, generator=torch.Generator().manual_seed(0))


def _tensors(seed: int, **shapes: tuple[int, ...]) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=g) * 0.5 for name, shape in shapes.items()}


def _write(directory: Path, cfg: dict, tensors: dict[str, torch.Tensor], weights: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "cfg.json").write_text(json.dumps(cfg))
    save_file(tensors, str(directory / weights))
    return directory


def _saelens_topk(directory: Path) -> dict[str, torch.Tensor]:
    t = _tensors(1, W_enc=(D, M), b_enc=(M,), W_dec=(M, D), b_dec=(D,))
    _write(directory, {"architecture": "topk", "d_in": D, "d_sae": M, "k": 4, "apply_b_dec_to_input": True,
                       "rescale_acts_by_decoder_norm": True, "normalize_activations": "none", "dtype": "float32",
                       "metadata": {"hook_name": "blocks.0.hook_resid_post", "sae_lens_version": "6.54.0"}},
           t, "sae_weights.safetensors")
    return t


def test_round_trip_of_every_kind_and_the_fingerprint(tmp_path: Path) -> None:
    model = testing.tiny_gpt2(100, hidden=16)
    for n, dictionary in enumerate([SparseAutoencoder(D, M, "batchtopk", k=3, node="a"),
                                    SparseAutoencoder(D, M, "jumprelu"), Transcoder(D, M, 4, "topk", k=2),
                                    SkipTranscoder(D, M, 5, "relu", input_node="a", output_node="b")]):
        with torch.no_grad():
            for parameter in dictionary.parameters():
                parameter.add_(0.1)
        save_dictionary(dictionary, tmp_path / str(n), model=model)
        loaded = load_dictionary(tmp_path / str(n), model=model)
        assert dataclasses.replace(loaded.config, model_fingerprint=None) == dictionary.config
        assert loaded.config.model_fingerprint == model_fingerprint(model)
        assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), dictionary.state_dict().values()))
        assert torch.equal(loaded.eval()(X), dictionary.eval()(X))
    with pytest.raises(FingerprintMismatchError, match="check_fingerprint=False"):
        load_dictionary(tmp_path / "0", model=testing.tiny_gpt2(100, hidden=16, seed=1))
    assert load_dictionary(tmp_path / "0", model=testing.tiny_gpt2(100, hidden=16, seed=1), check_fingerprint=False)


def test_saelens_topk_equals_saelens_equations_and_exports_back(tmp_path: Path) -> None:
    t = _saelens_topk(tmp_path / "saelens")
    sae = load_saelens(tmp_path / "saelens", node="model.layers_0.output")
    norm = t["W_dec"].norm(dim=-1)  # SAELens TopKSAE with rescale_acts_by_decoder_norm, written out
    h = ((X - t["b_dec"]) @ t["W_enc"] + t["b_enc"]) * norm
    values, indices = h.topk(4, dim=-1)
    z = torch.zeros_like(h).scatter(-1, indices, values.relu())
    assert (sae.encode(X) - z).abs().max() < 1e-5
    assert (sae.decode(z) - ((z / norm) @ t["W_dec"] + t["b_dec"])).abs().max() < 1e-5
    export_saelens(sae, tmp_path / "exported")
    cfg = json.loads((tmp_path / "exported" / "cfg.json").read_text())
    assert (cfg["architecture"], cfg["k"], cfg["d_in"], cfg["d_sae"]) == ("topk", 4, D, M)
    assert cfg["metadata"]["hook_name"] == "model.layers_0.output"
    again = load_saelens(tmp_path / "exported", node="model.layers_0.output")
    assert again.config == sae.config and torch.equal(again(X), sae(X))


@pytest.mark.parametrize("architecture", ["standard", "jumprelu", "skip_transcoder", "jumprelu_transcoder",
                                          "jumprelu_skip_transcoder"])
def test_saelens_other_architectures(tmp_path: Path, architecture: str) -> None:
    transcoder = "transcoder" in architecture
    d_out = 5 if transcoder else D
    t = _tensors(2, W_enc=(D, M), b_enc=(M,), W_dec=(M, d_out), b_dec=(d_out,))
    if "jumprelu" in architecture:
        t["threshold"] = torch.linspace(-0.2, 0.6, M)  # a negative θ: SAELens's ReLU(h)·H(h − θ) still holds
    if architecture.endswith("skip_transcoder"):
        t["W_skip"] = _tensors(3, W_skip=(d_out, D))["W_skip"]
    cfg = {"architecture": architecture, "d_in": D, "d_sae": M, "apply_b_dec_to_input": not transcoder}
    if transcoder:
        cfg["d_out"] = d_out
    loaded = load_saelens(_write(tmp_path, cfg, t, "sae_weights.safetensors"))
    h = (X - (0 if transcoder else t["b_dec"])) @ t["W_enc"] + t["b_enc"]
    z = h.relu() * (h > t["threshold"]) if "threshold" in t else h.relu()
    expected = z @ t["W_dec"] + t["b_dec"] + (X @ t["W_skip"].T if "W_skip" in t else 0)
    assert (loaded.encode(X) - z).abs().max() < 1e-5 and (loaded(X) - expected).abs().max() < 1e-5
    export_saelens(loaded, tmp_path / "out")
    assert json.loads((tmp_path / "out" / "cfg.json").read_text())["architecture"] == architecture
    assert torch.equal(load_saelens(tmp_path / "out")(X), loaded(X))


def test_sparsify_layout_equals_sparsify_equations(tmp_path: Path) -> None:
    t = _tensors(4, **{"encoder.weight": (M, D), "encoder.bias": (M,), "W_dec": (M, D), "b_dec": (D,)})
    cfg = {"activation": "topk", "expansion_factor": 32, "normalize_decoder": True, "num_latents": M, "k": 3,
           "multi_topk": False, "skip_connection": False, "transcode": False, "d_in": D}
    sae = load_sparsify(_write(tmp_path / "layers.0", cfg, t, "sae.safetensors"), node="model.layers_0.output")
    pre = torch.relu((X - t["b_dec"]) @ t["encoder.weight"].T + t["encoder.bias"])
    values, indices = pre.topk(3, dim=-1)
    expected = (values[..., None] * t["W_dec"][indices]).sum(-2) + t["b_dec"]
    assert (sae(X) - expected).abs().max() < 1e-5 and sae.config.input_node == "model.layers_0.output"
    t["W_skip"] = torch.zeros(D, D)
    skip = load_sparsify(_write(tmp_path / "skip", {**cfg, "transcode": True, "skip_connection": True}, t,
                                "sae.safetensors"))
    assert isinstance(skip, SkipTranscoder) and not skip.config.apply_b_dec_to_input


def test_circuit_tracer_set_loads_exports_and_reloads(tmp_path: Path) -> None:
    entries = []
    for layer in range(2):
        t = _tensors(5 + layer, W_enc=(M, D), W_dec=(D, M), b_enc=(M,), b_dec=(D,), W_skip=(D, D))
        save_file(t, str(tmp_path / f"layer_{layer}.safetensors"))
        entries.append({"id": f"t{layer}", "layer": layer, "filepath": f"layer_{layer}.safetensors"})
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({"model_name": "tiny", "feature_input_hook": "hook_resid_mid",
                                                          "feature_output_hook": "mlp.hook_out",
                                                          "transcoders": entries}))
    loaded = load_circuit_tracer(tmp_path / "config.yaml", "model.layers_{layer}.mlp.x",
                                 "model.layers_{layer}.mlp.output")
    expected = torch.relu(X @ t["W_enc"].T + t["b_enc"]) @ t["W_dec"].T + t["b_dec"] + X @ t["W_skip"].T
    assert (loaded[1](X) - expected).abs().max() < 1e-5
    assert loaded[1].config.output_node == "model.layers_1.mlp.output"
    config = export_circuit_tracer(loaded, tmp_path / "out", "tiny", "hook_resid_mid", "mlp.hook_out")
    again = load_circuit_tracer(config, "a{layer}", "b{layer}")
    assert all(torch.equal(again[i](X), loaded[i](X)) for i in range(2))


def test_bad_files_are_refused_before_anything_is_built(tmp_path: Path) -> None:
    t = _saelens_topk(tmp_path / "good")
    cfg = json.loads((tmp_path / "good" / "cfg.json").read_text())
    cases = {
        "wide": ({**cfg, "d_in": D + 1}, t, r"'W_enc' has shape \(6, 16\).*need \(7, 16\)"),
        "missing": (cfg, {k: v for k, v in t.items() if k != "b_enc"}, r"missing \['b_enc'\]"),
        "nan": (cfg, {**t, "W_dec": torch.full((M, D), float("nan"))}, "NaN"),
        "gated": ({**cfg, "architecture": "gated"}, t, "architecture 'gated'"),
        "normalised": ({**cfg, "normalize_activations": "layer_norm"}, t, "normalize_activations='layer_norm'"),
    }
    for name, (bad_cfg, tensors, message) in cases.items():
        with pytest.raises(DictionaryLoadError, match=message):
            load_saelens(_write(tmp_path / name, bad_cfg, tensors, "sae_weights.safetensors"))
    (tmp_path / "garbled").mkdir()
    (tmp_path / "garbled" / "cfg.json").write_text(json.dumps(cfg))
    (tmp_path / "garbled" / "sae_weights.safetensors").write_bytes(b"not safetensors at all")
    with pytest.raises(DictionaryLoadError, match="not a readable safetensors"):
        load_saelens(tmp_path / "garbled")
    with pytest.raises(DictionaryLoadError, match="use load_saelens"):
        load_dictionary(tmp_path / "good")
    with pytest.raises(DictionaryLoadError, match="use load_sparsify"):
        load_saelens(_write(tmp_path / "sparsify", {"d_in": D, "k": 3}, t, "sae.safetensors"))
    with pytest.raises(DictionaryLoadError, match="groupmax"):
        load_sparsify(_write(tmp_path / "groupmax", {"d_in": D, "activation": "groupmax"}, t, "sae.safetensors"))
    save_dictionary(SparseAutoencoder(D, M, "topk", k=2), tmp_path / "ours")
    save_file({"W_enc": torch.zeros(1)}, str(tmp_path / "ours" / "dictionary.safetensors"))
    with pytest.raises(DictionaryLoadError, match="different saves"):
        load_dictionary(tmp_path / "ours")
    (tmp_path / "ct.yaml").write_text(yaml.safe_dump({"transcoders": [
        {"id": "a", "layer": 0, "filepath": "hf://google/gemma-scope-2b-pt-transcoders/layer_0/params.npz"}]}))
    with pytest.raises(DictionaryLoadError, match="local .safetensors files only"):
        load_circuit_tracer(tmp_path / "ct.yaml", "a{layer}", "b{layer}")
    with pytest.raises(DictionaryConfigError, match="SAELens has no architecture"):
        export_saelens(Transcoder(D, M, activation="topk", k=2), tmp_path / "no")
    with pytest.raises(DictionaryConfigError, match="every layer"):
        export_circuit_tracer({1: Transcoder(D, M, activation="relu")}, tmp_path / "no", "m", "i", "o")
    diverged = SparseAutoencoder(D, M, "relu")
    with torch.no_grad():
        diverged.W_enc[0, 0] = float("inf")
    with pytest.raises(DictionaryLoadError, match=r"\['W_enc'\] hold NaN or ±inf; nothing was saved"):
        save_dictionary(diverged, tmp_path / "inf")
    assert not (tmp_path / "inf").exists()
    assert issubclass(DictionaryLoadError, GradpatchError)
