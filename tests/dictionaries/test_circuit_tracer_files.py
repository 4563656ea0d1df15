"""circuit-tracer's transcoder sets (gradpatch.dictionaries.load_circuit_tracer / export_circuit_tracer): files
written here by hand (safetensors) in circuit-tracer 0.5.0's layout, d797c82's and Gemma Scope 2's, every config.yaml
form 0.5.0 reads, checked against circuit-tracer's equations written out; W_dec's orientation decided by the file or
the caller, never guessed; bad sets refused; a set read and written back holds the same bytes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from gradpatch.dictionaries import (DictionaryConfigError, DictionaryLoadError, SkipTranscoder, Transcoder,
                                    export_circuit_tracer, load_circuit_tracer)

D, M = 6, 16
X = torch.randn(5, D, generator=torch.Generator().manual_seed(0))
NODES = ("model.layers_{layer}.mlp.x", "model.layers_{layer}.mlp.output")


def _layer(seed: int, d_sae: int = M, skip: bool = True, jump: bool = False) -> dict[str, torch.Tensor]:
    """One layer's tensors in circuit-tracer 0.5.0's layout (SingleLayerTranscoder.to_safetensors)."""
    g = torch.Generator().manual_seed(seed)
    shapes = {"W_enc": (d_sae, D), "W_dec": (d_sae, D), "b_enc": (d_sae,), "b_dec": (D,)}
    if skip:
        shapes["W_skip"] = (D, D)
    tensors = {name: torch.randn(shape, generator=g) * 0.5 for name, shape in shapes.items()}
    if jump:
        tensors["activation_function.threshold"] = torch.rand(d_sae, generator=g) * 0.5
    return tensors


def _expected(t: dict[str, torch.Tensor], x: torch.Tensor = X) -> torch.Tensor:
    """circuit-tracer's SingleLayerTranscoder.forward written out (0.5.0's layout)."""
    pre = x @ t["W_enc"].T + t["b_enc"]
    threshold = t.get("activation_function.threshold")
    z = torch.relu(pre) if threshold is None else pre * (pre > threshold)
    return z @ t["W_dec"] + t["b_dec"] + (x @ t["W_skip"].T if "W_skip" in t else 0)


def _set(folder: Path, layers: list[dict[str, torch.Tensor]], form: str = "list", **fields) -> Path:
    """Write ``layers`` and a config.yaml of ``form``: 0.5.0's ``list`` (relative paths), its ``cache`` form (no list)
    or the ``older`` {id, layer, filepath} entries."""
    folder.mkdir(parents=True, exist_ok=True)
    for layer, tensors in enumerate(layers):
        save_file(tensors, str(folder / f"layer_{layer}.safetensors"))
    names = [f"layer_{layer}.safetensors" for layer in range(len(layers))]
    document = {"model_kind": "transcoder_set", "feature_input_hook": "hook_resid_mid",
                "feature_output_hook": "hook_mlp_out", "scan": "tiny"}
    if form == "list":
        document["transcoders"] = names
    elif form == "older":
        del document["model_kind"]
        document["transcoders"] = [{"id": f"l{i}", "layer": i, "filepath": name} for i, name in enumerate(names)]
    document.update(fields)
    (folder / "config.yaml").write_text(yaml.safe_dump(document))
    return folder / "config.yaml"


@pytest.mark.parametrize("form", ["list", "cache"])
def test_a_050_set_loads_in_every_config_form(tmp_path: Path, form: str) -> None:
    layers = [_layer(1, jump=True), _layer(2, skip=True)]
    loaded = load_circuit_tracer(_set(tmp_path, layers, form), *NODES)
    assert sorted(loaded) == [0, 1]
    assert loaded[0].config.activation == "jumprelu" and loaded[1].config.activation == "relu"
    assert isinstance(loaded[1], SkipTranscoder) and loaded[1].config.output_node == "model.layers_1.mlp.output"
    for layer, tensors in enumerate(layers):
        assert (loaded[layer](X) - _expected(tensors)).abs().max() < 1e-5
    assert torch.equal(load_circuit_tracer(tmp_path, *NODES)[1].W_dec, loaded[1].W_dec)  # the folder works too


def test_the_older_layout_and_gemma_scope_2_give_the_same_transcoder(tmp_path: Path) -> None:
    t = _layer(3, jump=True)
    older = {**t, "W_dec": t["W_dec"].T.contiguous()}  # d797c82: W_dec [d_model, d_sae]
    gemma = {"w_enc": t["W_enc"].T.contiguous(), "w_dec": t["W_dec"], "b_enc": t["b_enc"], "b_dec": t["b_dec"],
             "threshold": t["activation_function.threshold"], "affine_skip_connection": t["W_skip"].T.contiguous()}
    for name, tensors, form in (("older", older, "older"), ("gemma", gemma, "list")):
        loaded = load_circuit_tracer(_set(tmp_path / name, [tensors], form), *NODES)[0]
        assert (loaded(X) - _expected(t)).abs().max() < 1e-5, name
        config = export_circuit_tracer({0: loaded}, tmp_path / f"{name}_out", "tiny", "hook_resid_mid", "hook_mlp_out")
        written = load_file(str(config.parent / "layer_0.safetensors"))  # in 0.5.0's layout, whatever was read
        assert all(torch.equal(written[key], t[key]) for key in t), name


def test_a_square_set_is_decided_by_its_metadata_or_the_caller_never_guessed(tmp_path: Path) -> None:
    t = _layer(4, d_sae=D)  # d_sae == d_model: W_dec's shape says nothing
    config = _set(tmp_path / "square", [t])
    with pytest.raises(DictionaryLoadError, match=r"d_sae == d_model == 6.*layout='latent_rows'.*"
                                                  r"layout='latent_columns'"):
        load_circuit_tracer(config, *NODES)
    rows = load_circuit_tracer(config, *NODES, layout="latent_rows")[0]
    columns = load_circuit_tracer(config, *NODES, layout="latent_columns")[0]
    assert (rows(X) - _expected(t)).abs().max() < 1e-5
    assert torch.equal(columns.W_dec, t["W_dec"].T) and not torch.equal(columns.W_dec, rows.W_dec)
    field = _set(tmp_path / "field", [t], layout="latent_columns")
    assert torch.equal(load_circuit_tracer(field, *NODES)[0].W_dec, columns.W_dec)
    with pytest.raises(DictionaryLoadError, match="says layout 'latent_columns' but layout='latent_rows'"):
        load_circuit_tracer(field, *NODES, layout="latent_rows")
    exported = export_circuit_tracer({0: rows}, tmp_path / "exported", "tiny", "hook_resid_mid", "hook_mlp_out")
    with safe_open(str(tmp_path / "exported" / "layer_0.safetensors"), framework="pt") as handle:
        assert handle.metadata()["decoder_layout"] == "latent_rows"
    assert torch.equal(load_circuit_tracer(exported, *NODES)[0].W_dec, rows.W_dec)  # its metadata decides
    with pytest.raises(DictionaryLoadError, match=r"records decoder_layout='latent_rows' \(its metadata.*but "
                                                  r"layout='latent_columns'"):
        load_circuit_tracer(exported, *NODES, layout="latent_columns")
    with pytest.raises(DictionaryLoadError, match="layout 'sideways' is not one of"):
        load_circuit_tracer(_set(tmp_path / "bad", [t], layout="sideways"), *NODES)


def test_a_set_read_and_written_back_holds_the_same_bytes(tmp_path: Path) -> None:
    for name, layers in {"skip": [_layer(5, jump=True), _layer(6, jump=True)],
                         "plain": [_layer(7, skip=False), _layer(8, skip=False)],
                         "bf16": [{k: v.bfloat16() for k, v in _layer(9).items()}]}.items():
        loaded = load_circuit_tracer(_set(tmp_path / name, layers), *NODES)
        config = export_circuit_tracer(loaded, tmp_path / f"{name}_out", "tiny", "hook_resid_mid", "hook_mlp_out")
        document = yaml.safe_load(config.read_text())
        assert document["model_kind"] == "transcoder_set" and document["scan"] == "tiny"
        assert [Path(p).name for p in document["transcoders"]] == [f"layer_{i}.safetensors" for i in range(len(layers))]
        for layer, tensors in enumerate(layers):
            written = load_file(document["transcoders"][layer])
            assert sorted(written) == sorted(tensors), name
            for key, tensor in tensors.items():
                assert written[key].dtype == tensor.dtype and written[key].shape == tensor.shape
                assert written[key].numpy().tobytes() == tensor.numpy().tobytes() if tensor.dtype != torch.bfloat16 \
                    else torch.equal(written[key].view(torch.int16), tensor.view(torch.int16)), (name, key)


def test_export_gives_every_layer_a_skip_term_or_none_and_refuses_what_circuit_tracer_cannot_read(
        tmp_path: Path) -> None:
    mixed = {0: SkipTranscoder(D, M, activation="relu"), 1: Transcoder(D, M, activation="relu")}
    config = export_circuit_tracer(mixed, tmp_path / "mixed", "tiny", "hook_resid_mid", "hook_mlp_out")
    assert torch.equal(load_file(str(tmp_path / "mixed" / "layer_1.safetensors"))["W_skip"], torch.zeros(D, D))
    again = load_circuit_tracer(config, *NODES)
    assert torch.allclose(again[1](X), mixed[1](X), atol=1e-6)
    cases = {"every layer": {1: Transcoder(D, M, activation="relu")},
             "activation topk": {0: Transcoder(D, M, activation="topk", k=2)},
             "d_in=6, d_out=5": {0: Transcoder(D, M, activation="relu", d_out=5)},
             "one d_sae": {0: Transcoder(D, M, activation="relu"), 1: Transcoder(D, M + 1, activation="relu")}}
    for message, transcoders in cases.items():
        with pytest.raises(DictionaryConfigError, match=message):
            export_circuit_tracer(transcoders, tmp_path / "no", "m", "i", "o")
    assert not (tmp_path / "no").exists()  # every layer checked before anything is written


@pytest.mark.parametrize("case, message", [
    ("missing", r"missing \['b_dec'\]"),
    ("wide_enc", r"'W_enc' has shape \(16, 7\), but b_enc \[16\] and b_dec \[6\] need \(16, 6\)"),
    ("wide_dec", r"'W_dec' has shape \(16, 7\), but b_enc \[16\] and b_dec \[6\] need \(16, 6\)"),
    ("wide_skip", r"'W_skip' has shape \(6, 7\)"),
    ("extra", r"unexpected \['W_extra'\]"),
    ("nan", "NaN"),
    ("log_thresholds", "'log_thresholds'"),
])
def test_bad_files_are_refused(tmp_path: Path, case: str, message: str) -> None:
    t = _layer(10)
    bad = {"missing": {k: v for k, v in t.items() if k != "b_dec"},
           "wide_enc": {**t, "W_enc": torch.zeros(M, D + 1)},
           "wide_dec": {**t, "W_dec": torch.zeros(M, D + 1)},
           "wide_skip": {**t, "W_skip": torch.zeros(D, D + 1)},
           "extra": {**t, "W_extra": torch.zeros(2)},
           "nan": {**t, "b_enc": torch.full((M,), float("nan"))},
           "log_thresholds": {**t, "log_thresholds": torch.zeros(M)}}[case]
    with pytest.raises(DictionaryLoadError, match=message):
        load_circuit_tracer(_set(tmp_path, [_layer(11), bad]), *NODES)


def test_bad_sets_are_refused_with_the_fix(tmp_path: Path) -> None:
    t = _layer(12)
    remote = _set(tmp_path / "remote", [t])
    remote.write_text(yaml.safe_dump({"model_kind": "transcoder_set",
                                      "transcoders": ["hf://mntss/transcoder-Llama-3.2-1B/layer_0.safetensors"]}))
    with pytest.raises(DictionaryLoadError, match="local .safetensors files only: download it first"):
        load_circuit_tracer(remote, *NODES)
    npz = _set(tmp_path / "npz", [t])
    npz.write_text(yaml.safe_dump({"transcoders": [{"id": "a", "layer": 0, "filepath": "params.npz"}]}))
    with pytest.raises(DictionaryLoadError, match="Gemma Scope .npz file; convert it"):
        load_circuit_tracer(npz, *NODES)
    clt = _set(tmp_path / "clt", [t], model_kind="cross_layer_transcoder")
    with pytest.raises(DictionaryLoadError, match="cross-layer transcoder.*load_circuit_tracer_clt"):
        load_circuit_tracer(clt, *NODES)
    (tmp_path / "clt_folder").mkdir()
    save_file({"W_enc_0": torch.zeros(M, D)}, str(tmp_path / "clt_folder" / "W_enc_0.safetensors"))
    with pytest.raises(DictionaryLoadError, match="cross-layer transcoder.*load_circuit_tracer_clt"):
        load_circuit_tracer(tmp_path / "clt_folder", *NODES)
    with pytest.raises(DictionaryLoadError, match="model_kind 'sae'"):
        load_circuit_tracer(_set(tmp_path / "kind", [t], model_kind="sae"), *NODES)
    gap = _set(tmp_path / "gap", [t, t])
    (tmp_path / "gap" / "layer_0.safetensors").rename(tmp_path / "gap" / "layer_2.safetensors")
    gap.write_text(yaml.safe_dump({"model_kind": "transcoder_set"}))
    with pytest.raises(DictionaryLoadError, match=r"layers \[1, 2\]; circuit-tracer needs one transcoder for every"):
        load_circuit_tracer(gap, *NODES)
    with pytest.raises(DictionaryLoadError, match="neither a path"):
        load_circuit_tracer(_set(tmp_path / "entry", [t], transcoders=[3]), *NODES)
