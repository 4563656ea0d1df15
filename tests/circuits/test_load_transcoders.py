"""One path from training to tracing: gradpatch.circuits.load_transcoders reads what ``gradpatch fit`` writes (its
output folder or its ``dictionary/`` folder, one dictionary or one folder per written node) into {layer: transcoder},
each placed by the MLP output it writes under the model's layout; what is not an MLP output's transcoder is refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gradpatch import PatchableGraph, testing
from gradpatch.circuits import CircuitError, ReplacementModel, load_transcoders
from gradpatch.dictionaries import SkipTranscoder, SparseAutoencoder, save_dictionary
from gradpatch.errors import FingerprintMismatchError
from gradpatch.layouts import detect_layout

IDS = torch.randint(0, 100, (1, 5), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def setup() -> tuple[torch.nn.Module, PatchableGraph, str, str]:
    model = testing.tiny_llama(100, hidden=64, intermediate=128, init_std=0.02, max_position_embeddings=64,
                               pad_token_id=None, bos_token_id=1, eos_token_id=2)
    pg = PatchableGraph(model, IDS, use_cache=False)
    layout = detect_layout(pg)
    return model, pg, layout.template("mlp_input"), layout.template("mlp")


def _transcoder(layer: int, read: str, write: str, seed: int) -> SkipTranscoder:
    return SkipTranscoder(64, 32, activation="relu", input_node=read.format(layer=layer),
                          output_node=write.format(layer=layer), generator=torch.Generator().manual_seed(seed))


def test_what_fit_writes_loads_by_the_mlp_output_each_writes(setup, tmp_path: Path) -> None:
    model, pg, read, write = setup
    trained = {layer: _transcoder(layer, read, write, seed=layer) for layer in (1, 0)}
    for transcoder in trained.values():  # gradpatch fit's several dictionaries: D/dictionary/<written node>/
        save_dictionary(transcoder, tmp_path / "run" / "dictionary" / transcoder.config.output_node, model=model)
    for folder in (tmp_path / "run", tmp_path / "run" / "dictionary"):
        loaded = load_transcoders(folder, model, read, write)
        assert sorted(loaded) == [0, 1]
        assert all(torch.equal(loaded[layer].W_dec, trained[layer].W_dec) for layer in (0, 1))
    ReplacementModel(pg, loaded, IDS)  # builds: each transcoder spliced at its layer's MLP
    save_dictionary(trained[1], tmp_path / "one" / "dictionary", model=model)  # one dictionary: D/dictionary/
    assert list(load_transcoders(tmp_path / "one", model, read, write)) == [1]


def test_dictionaries_that_are_not_an_mlp_outputs_transcoder_are_refused(setup, tmp_path: Path) -> None:
    model, _, read, write = setup
    save_dictionary(SparseAutoencoder(64, 32, "relu", node="model.layers_0.output"), tmp_path / "sae" / "a")
    with pytest.raises(CircuitError, match="holds a sparse autoencoder.*needs transcoders"):
        load_transcoders(tmp_path / "sae", model, read, write)
    attention = _transcoder(0, read, "model.layers_{layer}.self_attn.output", 1)
    save_dictionary(attention, tmp_path / "attn" / "dictionary" / "x")
    with pytest.raises(CircuitError, match=r"writes model.layers_0.self_attn.output, which is not an MLP output of "
                                           r"this model's layout \(model.layers_\{layer\}.mlp.output"):
        load_transcoders(tmp_path / "attn", model, read, write)
    for name in ("a", "b"):
        save_dictionary(_transcoder(1, read, write, 2), tmp_path / "twice" / name)
    with pytest.raises(CircuitError, match="both write layer 1's MLP output"):
        load_transcoders(tmp_path / "twice", model, read, write)
    save_dictionary(_transcoder(1, read, write, 3), tmp_path / "moved" / "layer_0")
    with pytest.raises(CircuitError, match="layer_0 holds a transcoder of layer 1's MLP output"):
        load_transcoders(tmp_path / "moved", model, read, write)
    other = testing.tiny_llama(100, hidden=64, intermediate=128, init_std=0.02, max_position_embeddings=64,
                               pad_token_id=None, bos_token_id=1, eos_token_id=2, seed=5)
    save_dictionary(_transcoder(0, read, write, 4), tmp_path / "other" / "dictionary", model=other)
    with pytest.raises(FingerprintMismatchError):
        load_transcoders(tmp_path / "other", model, read, write)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CircuitError, match="gradpatch fit's dictionary/ folder"):
        load_transcoders(tmp_path / "empty", model, read, write)
