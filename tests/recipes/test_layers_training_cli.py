"""``gradpatch fit`` on the tiny Llama saved to disk with dictionaries at every layer: a ``dictionary:`` spec with
``layers: all`` writes one save_dictionary folder per MLP output node and a metrics.json with every layer (spliced
alone) and ``all_spliced`` (the skip terms fitted by least squares when the config asks); a ``clt:`` section writes a loadable cross-layer transcoder and the same metrics."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
import yaml

from gradpatch.dictionaries import load_clt, load_dictionary
from gradpatch.files.loaders import load_model
from recipes import cli
from recipes.testing import WORDS, save_tiny_backbone

NODES = ["model.layers_0.mlp.output", "model.layers_1.mlp.output"]
ALL_SPLICED = {"ce_loss_original", "ce_loss_spliced", "ce_loss_zero_ablation", "ce_loss_recovered", "kl", "n_layers"}


@pytest.fixture(scope="module")
def backbone(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny backbone and a text corpus."""
    torch.set_num_threads(1)
    folder = tmp_path_factory.mktemp("layers_cli")
    rng = random.Random(0)
    corpus = folder / "corpus.txt"
    corpus.write_text("\n".join(" ".join(rng.choices(WORDS, k=rng.randint(8, 20))) for _ in range(80)) + "\n")
    return {"folder": folder, "model": save_tiny_backbone(folder / "tiny"), "corpus": corpus}


def _fit(backbone: dict[str, Path], name: str, model: dict[str, object]) -> Path:
    config = {
        "trainer": {"accelerator": "cpu", "enable_progress_bar": False, "logger": False},
        "model": {"buffer_rows": 64, "lr": 0.01, "dead_after_tokens": 64, "lr_warmup_steps": 2,
                  "lr_decay_fraction": 0.2, "ce_every_n_steps": 2, **model},
        "data": {"corpus": str(backbone["corpus"]), "train_tokens": 640, "chunk_length": 16, "batch_size": 4,
                 "eval_tokens": 96, "max_length": 32},
    }
    path = backbone["folder"] / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    root = backbone["folder"] / name
    assert cli.main(["fit", "--config", str(path), "--model", str(backbone["model"]),
                     "--trainer.default_root_dir", str(root)]) == 0
    return root


def _check_metrics(root: Path) -> None:
    """metrics.json holds each layer spliced alone, over the same held-out tokens, and all layers spliced at once."""
    document = json.loads((root / "metrics.json").read_text())
    assert list(document["dictionaries"]) == NODES and set(document["all_spliced"]) == ALL_SPLICED
    assert document["all_spliced"]["n_layers"] == 2
    tokens = {metrics["n_tokens"] for metrics in document["dictionaries"].values()}
    assert len(tokens) == 1 and 0 < tokens.pop() < 96  # 2 positions of each held-out document left out
    assert all(metrics["l0"] <= 4 for metrics in document["dictionaries"].values())


def test_fit_trains_skip_transcoders_at_every_mlp_in_one_run(backbone: dict[str, Path]) -> None:
    root = _fit(backbone, "transcoders", {"dictionary": {
        "node": "mlp_input", "output_node": "mlp", "layers": "all", "kind": "skip_transcoder", "k": 4,
        "expansion_factor": 2, "exclude_first_positions": 2}, "b_dec_init": "geometric_median"})
    _check_metrics(root)
    model, _ = load_model(backbone["model"])
    for layer, node in enumerate(NODES):  # one save_dictionary folder per written node
        transcoder = load_dictionary(root / "dictionary" / node, model=model)
        assert transcoder.config.input_node == f"model.layers_{layer}.mlp.x"
        assert transcoder.config.kind == "skip_transcoder" and transcoder.d_sae == 128


def test_fit_takes_the_least_squares_skip_init_from_the_config(backbone: dict[str, Path]) -> None:
    """``model.skip_init: least_squares`` reaches the module: the saved skip terms are the fitted ones, not ~0 (Adam at
    lr 1e-6 moves a zero-started W_skip by ~1e-6 per entry per step, 4e-5 over this run's ≤ 40 steps)."""
    root = _fit(backbone, "transcoders_lsq", {"dictionary": {
        "node": "mlp_input", "output_node": "mlp", "layers": "all", "kind": "skip_transcoder", "k": 4,
        "expansion_factor": 2, "exclude_first_positions": 2}, "skip_init": "least_squares", "skip_ridge": 0.01,
        "lr": 1e-6})
    _check_metrics(root)
    model, _ = load_model(backbone["model"])
    for node in NODES:
        assert float(load_dictionary(root / "dictionary" / node, model=model).W_skip.abs().max()) > 1e-3


def test_fit_trains_a_cross_layer_transcoder(backbone: dict[str, Path]) -> None:
    root = _fit(backbone, "clt", {"clt": {"activation": "topk", "k": 4, "expansion_factor": 2,
                                          "exclude_first_positions": 2}})
    _check_metrics(root)
    model, _ = load_model(backbone["model"])
    clt = load_clt(root / "dictionary", model=model)
    assert clt.config.output_nodes == NODES and (clt.n_layers, clt.d_sae, clt.config.k) == (2, 128, 4)
