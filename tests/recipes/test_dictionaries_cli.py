"""The dictionary commands on the tiny Llama saved to disk: ``gradpatch fit`` on a dictionary config writes the
dictionary, metrics.json and TensorBoard's FVU, L0, dead fraction and feature density; ``gradpatch dictionary eval``
writes metrics.json, and refuses bad input with status 2, writing nothing; the corpus reader."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
import yaml
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from gradpatch.dictionaries import SparseAutoencoder, load_dictionary, save_dictionary
from recipes import cli
from recipes.dictionary import packed_chunks, read_documents, tokenize_documents
from recipes.errors import RecipeConfigError
from recipes.testing import WORDS, save_tiny_backbone, tiny_tokenizer

KEYS = {"fvu", "explained_variance", "l0", "dead_fraction", "ce_loss_original", "ce_loss_spliced",
        "ce_loss_zero_ablation", "ce_loss_recovered", "kl", "n_tokens",
        # the same numbers under SAELens's names
        "ce_loss_without_sae", "ce_loss_with_sae", "ce_loss_with_ablation", "ce_loss_score", "kl_div_with_sae"}


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny backbone, a text corpus, and ``gradpatch fit`` of a TopK SAE on them (its root folder)."""
    torch.set_num_threads(1)
    folder = tmp_path_factory.mktemp("dictionary_cli")
    model = save_tiny_backbone(folder / "tiny")
    rng = random.Random(0)
    corpus = folder / "corpus.txt"
    corpus.write_text("\n".join(" ".join(rng.choices(WORDS, k=rng.randint(8, 20))) for _ in range(80)) + "\n")
    config = {
        "trainer": {"accelerator": "cpu", "enable_progress_bar": False, "log_every_n_steps": 1},
        "model": {"dictionary": {"node": "model.layers_1.output", "k": 4, "expansion_factor": 2},
                  "buffer_rows": 64, "lr": 0.01, "dead_after_tokens": 64, "density_every_n_steps": 2},
        "data": {"corpus": str(corpus), "train_tokens": 640, "chunk_length": 16, "batch_size": 4,
                 "eval_tokens": 96, "max_length": 32},
    }
    config_path = folder / "sae.yaml"
    config_path.write_text(yaml.safe_dump(config))
    root = folder / "run"
    status = cli.main(["fit", "--config", str(config_path), "--model", str(model),
                       "--trainer.default_root_dir", str(root)])
    assert status == 0
    return {"model": model, "corpus": corpus, "root": root}


def test_fit_writes_the_dictionary_its_metrics_and_tensorboard(trained: dict[str, Path]) -> None:
    root = trained["root"]
    from gradpatch.files.loaders import load_model

    model, _ = load_model(trained["model"])
    sae = load_dictionary(root / "dictionary", model=model)  # the fingerprint matches
    assert (sae.config.input_node, sae.d_in, sae.d_sae, sae.config.k) == ("model.layers_1.output", 64, 128, 4)
    metrics = json.loads((root / "metrics.json").read_text())["dictionaries"]["model.layers_1.output"]
    assert set(metrics) == KEYS and metrics["n_tokens"] == 96 and 0 < metrics["fvu"] < 1
    assert metrics["l0"] <= 4 and metrics["explained_variance"] == pytest.approx(1 - metrics["fvu"])
    (version,) = (root / "lightning_logs").iterdir()
    events = EventAccumulator(str(version), size_guidance={"scalars": 0, "histograms": 0})
    events.Reload()
    assert {"fvu", "l0", "dead_fraction"} <= set(events.Tags()["scalars"])
    densities = events.Histograms("feature_density_log10")
    assert [event.step for event in densities] == [2, 4, 6, 8, 10]  # one pass: 40 chunks / 4 = 10 steps
    assert densities[0].histogram_value.max <= 0 and densities[0].histogram_value.min >= -10


def test_eval_writes_metrics_json_over_the_token_budget(trained: dict[str, Path], tmp_path: Path) -> None:
    corpus = tmp_path / "texts.jsonl"
    corpus.write_text("\n".join(json.dumps({"text": line, "id": i}) for i, line in
                                enumerate(trained["corpus"].read_text().splitlines())))
    out = tmp_path / "eval"
    assert cli.main(["dictionary", "eval", "--dictionary", str(trained["root"] / "dictionary"),
                     "--model", str(trained["model"]), "--corpus", str(corpus), "--tokens", "100",
                     "--max-length", "12", "--out", str(out)]) == 0
    document = json.loads((out / "metrics.json").read_text())
    assert set(document) == {"dictionaries", "provenance"}
    metrics = document["dictionaries"]["model.layers_1.output"]
    documents, _ = tokenize_documents(tiny_tokenizer(), read_documents(corpus), 100, 12)
    assert set(metrics) == KEYS
    assert metrics["n_tokens"] == sum(map(len, documents)) >= 99  # < 2 tokens left: stop
    assert metrics["kl"] > 0 and 0 <= metrics["dead_fraction"] < 1
    assert metrics["ce_loss_recovered"] == pytest.approx(
        (metrics["ce_loss_zero_ablation"] - metrics["ce_loss_spliced"])
        / (metrics["ce_loss_zero_ablation"] - metrics["ce_loss_original"]))


def test_eval_leaves_out_the_first_positions_it_is_told(trained: dict[str, Path], tmp_path: Path) -> None:
    def metrics(*extra: str) -> dict:
        out = tmp_path / f"eval{len(extra)}"
        assert cli.main(["dictionary", "eval", "--dictionary", str(trained["root"] / "dictionary"), "--model",
                         str(trained["model"]), "--corpus", str(trained["corpus"]), "--tokens", "60",
                         "--max-length", "12", "--out", str(out), *extra]) == 0
        return json.loads((out / "metrics.json").read_text())["dictionaries"]["model.layers_1.output"]

    every, later = metrics(), metrics("--exclude-first-positions", "2")
    documents, _ = tokenize_documents(tiny_tokenizer(), read_documents(trained["corpus"]), 60, 12)
    assert every["n_tokens"] == sum(map(len, documents)) and later["n_tokens"] == every["n_tokens"] - 2 * len(documents)
    assert later["ce_loss_original"] == every["ce_loss_original"] and later["fvu"] != every["fvu"]


@pytest.mark.parametrize("case", ["missing", "format", "node", "width", "corpus", "empty", "positions"])
def test_eval_refuses_bad_input_with_status_2_and_writes_nothing(trained: dict[str, Path], tmp_path: Path,
                                                                 case: str, capsys: pytest.CaptureFixture) -> None:
    dictionary, extra = trained["root"] / "dictionary", []
    if case == "missing":
        dictionary = tmp_path / "nothing"
    elif case == "format":
        extra = ["--format", "saelens", "--node", "model.layers_1.output"]
    elif case == "node":
        extra = ["--node", "model.layers_7.output"]
    elif case == "width":
        dictionary = save_dictionary(SparseAutoencoder(32, 64, "topk", k=4, node="model.layers_1.output"),
                                     tmp_path / "narrow")
    elif case == "corpus":
        (tmp_path / "texts.csv").write_text("the city\n")
        extra = ["--corpus", str(tmp_path / "texts.csv")]
    elif case == "positions":
        extra = ["--exclude-first-positions", "-1"]
    else:
        (tmp_path / "texts.txt").write_text("city\n\nRome\n")  # one token per document
        extra = ["--corpus", str(tmp_path / "texts.txt")]
    out = tmp_path / "eval"
    assert cli.main(["dictionary", "eval", "--dictionary", str(dictionary), "--model", str(trained["model"]),
                     "--out", str(out), *extra]) == 2
    expected = {"missing": "is not a folder", "format": "cfg.json", "node": "model.layers_7.output",
                "width": "width is 32", "corpus": ".txt file", "empty": "gave no document of 2 tokens",
                "positions": "exclude_first_positions must be an int >= 0"}[case]
    assert expected in capsys.readouterr().err
    assert not out.exists()


def test_corpus_reader_and_token_budget(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("the city\n\nof Rome is big\n")
    (tmp_path / "a.jsonl").write_text('{"text": "the city"}\n\n{"text": "of Rome is big", "x": 1}\n')
    assert read_documents(tmp_path / "a.txt") == read_documents(tmp_path / "a.jsonl") == ["the city", "of Rome is big"]
    (tmp_path / "b.jsonl").write_text('{"title": "no text"}\n')
    with pytest.raises(RecipeConfigError, match="line 1"):
        read_documents(tmp_path / "b.jsonl")
    with pytest.raises(FileNotFoundError):
        read_documents(tmp_path / "none.txt")
    tokenizer = tiny_tokenizer()
    documents = ["the city of Rome", "a", "the dog is big and red", "my cat"]
    ids, read = tokenize_documents(tokenizer, documents, tokens=7, max_length=3)
    assert [len(d) for d in ids] == [3, 3] and read == 3  # "a" is one token: skipped; 7 − 6 = 1 left < 2
    assert ids[1] == tokenizer("the dog is")["input_ids"]
    chunks = packed_chunks(tokenizer, documents, count=2, length=4, max_length=8)
    assert chunks.shape == (2, 4) and chunks.flatten().tolist() == tokenizer("the city of Rome the dog is big")[
        "input_ids"]


def test_the_shipped_config_parses(capsys: pytest.CaptureFixture) -> None:
    config_path = Path(__file__).resolve().parents[2] / "recipes" / "configs" / "sae_smollm2.yaml"
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["fit", "--config", str(config_path), "--print_config"])
    assert exit_info.value.code == 0
    config = yaml.safe_load(capsys.readouterr().out)
    assert config["model"]["model_path"] is None and config["data"]["corpus"] is None
    spec = config["model"]["dictionary"]
    assert (spec["node"], spec["kind"], spec["activation"], spec["k"], spec["expansion_factor"]) == (
        "model.layers_12.output", "sae", "topk", 32, 4)
    assert (config["trainer"]["max_epochs"], config["trainer"]["max_steps"]) == (1, -1)


def _fit_config(trained: dict[str, Path], folder: Path, model: dict) -> Path:
    """``gradpatch fit`` on ``model`` (the config's ``model:``) over the trained fixture's corpus; returns the root."""
    config = {"trainer": {"accelerator": "cpu", "enable_progress_bar": False, "log_every_n_steps": 1}, "model": model,
              "data": {"corpus": str(trained["corpus"]), "train_tokens": 256, "chunk_length": 16, "batch_size": 4,
                       "eval_tokens": 64, "max_length": 32}}
    (folder / "config.yaml").write_text(yaml.safe_dump(config))
    root = folder / "run"
    assert cli.main(["fit", "--config", str(folder / "config.yaml"), "--model.model_path", str(trained["model"]),
                     "--trainer.default_root_dir", str(root)]) == 0
    return root


def _scalars(root: Path) -> set[str]:
    (version,) = (root / "lightning_logs").iterdir()
    events = EventAccumulator(str(version), size_guidance={"scalars": 0})
    events.Reload()
    return set(events.Tags()["scalars"])


def test_fit_trains_end_to_end_from_a_config(trained: dict[str, Path], tmp_path: Path) -> None:
    root = _fit_config(trained, tmp_path, {
        "class_path": "recipes.dictionary.EndToEndDictionaryFitModule",
        "init_args": {"dictionary": {"node": "model.layers_0.output", "k": 4, "expansion_factor": 2}, "lr": 0.01,
                      "downstream_nodes": ["model.layers_1.output"], "downstream_coefficient": 1.0}})
    from gradpatch.files.loaders import load_model

    sae = load_dictionary(root / "dictionary", model=load_model(trained["model"])[0])
    assert (sae.config.input_node, sae.d_sae) == ("model.layers_0.output", 128)
    metrics = json.loads((root / "metrics.json").read_text())["dictionaries"]["model.layers_0.output"]
    assert set(metrics) == KEYS and metrics["n_tokens"] == 64
    assert {"kl", "ce_increase", "downstream_mse", "fvu", "l0", "dead_fraction"} <= _scalars(root)


def test_fit_trains_several_dictionaries_in_one_run(trained: dict[str, Path], tmp_path: Path) -> None:
    root = _fit_config(trained, tmp_path, {
        "dictionary": [{"node": "model.layers_0.output", "k": 4, "expansion_factor": 2},
                       {"node": "model.layers_1.mlp.x", "kind": "transcoder",
                        "output_node": "model.layers_1.mlp.output", "k": 4, "d_sae": 96}],
        "buffer_rows": 32, "lr": 0.01, "ce_every_n_steps": 2})
    metrics = json.loads((root / "metrics.json").read_text())["dictionaries"]
    assert set(metrics) == {"model.layers_0.output", "model.layers_1.mlp.output"}
    assert all(set(scores) == KEYS and 0 < scores["fvu"] for scores in metrics.values())
    for node in metrics:
        assert (root / "dictionary" / node / "dictionary.safetensors").is_file()
    assert {"ce_increase", "fvu/model.layers_0.output", "fvu/model.layers_1.mlp.output"} <= _scalars(root)


def test_the_shipped_e2e_config_parses(capsys: pytest.CaptureFixture) -> None:
    config_path = Path(__file__).resolve().parents[2] / "recipes" / "configs" / "sae_smollm2_e2e.yaml"
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["fit", "--config", str(config_path), "--print_config"])
    assert exit_info.value.code == 0
    model = yaml.safe_load(capsys.readouterr().out)["model"]
    assert model["class_path"] == "recipes.dictionary.EndToEndDictionaryFitModule"
    assert (model["init_args"]["downstream_nodes"], model["init_args"]["downstream_coefficient"]) == ("residual", 0.001)
    assert model["init_args"]["dictionary"]["node"] == "model.layers_12.output"


def test_fit_resumes_mid_run_from_a_checkpoint(trained: dict[str, Path], tmp_path: Path) -> None:
    """A one-pass run checkpointed every 3 steps, resumed from step 3 with ``--ckpt_path``: the data module goes on
    from the next batch and the module from its buffer, so the dictionary is the uninterrupted run's."""
    model = {"dictionary": {"node": "model.layers_1.output", "k": 4, "expansion_factor": 2}, "buffer_rows": 128,
             "lr": 0.01, "dead_after_tokens": 64}
    checkpoints = tmp_path / "checkpoints"
    callback = {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                "init_args": {"dirpath": str(checkpoints), "every_n_train_steps": 3, "save_top_k": -1}}
    config = {"trainer": {"accelerator": "cpu", "enable_progress_bar": False, "enable_checkpointing": True,
                          "callbacks": [callback]}, "model": model,
              "data": {"corpus": str(trained["corpus"]), "train_tokens": 640, "chunk_length": 16, "batch_size": 4,
                       "eval_tokens": 64, "max_length": 32}}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    arguments = ["fit", "--config", str(tmp_path / "config.yaml"), "--model.model_path", str(trained["model"])]
    assert cli.main([*arguments, "--trainer.default_root_dir", str(tmp_path / "straight")]) == 0
    step3 = checkpoints / "epoch=0-step=3.ckpt"
    assert step3.is_file()
    assert cli.main([*arguments, "--trainer.default_root_dir", str(tmp_path / "resumed"), "--ckpt_path",
                     str(step3), "--trainer.callbacks", "[]"]) == 0
    straight = load_dictionary(tmp_path / "straight" / "dictionary", check_fingerprint=False)
    resumed = load_dictionary(tmp_path / "resumed" / "dictionary", check_fingerprint=False)
    for name, tensor in resumed.state_dict().items():
        torch.testing.assert_close(tensor, straight.state_dict()[name], rtol=1e-5, atol=1e-6)
    first = torch.load(step3, weights_only=False)["state_dict"]["dictionaries.0.W_enc"]
    assert not torch.allclose(first, straight.W_enc)


def test_eval_refuses_an_earlier_run_then_replaces_it_and_records_the_dictionary(
        trained: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """metrics.json says which dictionary it scored (and the command line, corpus, versions); an --out of an earlier
    run is refused naming --overwrite and left as it was, then replaced whole; a progress bar counts the documents."""
    out = tmp_path / "eval"
    out.mkdir()
    (out / "metrics.json").write_text('{"fvu": 0.5}')
    (out / "notes.txt").write_text("earlier")
    args = ["dictionary", "eval", "--dictionary", str(trained["root"] / "dictionary"), "--model",
            str(trained["model"]), "--corpus", str(trained["corpus"]), "--tokens", "40", "--max-length", "12",
            "--out", str(out)]
    assert cli.main(args) == 2
    assert f"--out {out} holds an earlier run; give --overwrite" in capsys.readouterr().err
    assert (out / "metrics.json").read_text() == '{"fvu": 0.5}' and (out / "notes.txt").is_file()
    assert cli.main([*args, "--overwrite"]) == 0
    documents, _ = tokenize_documents(tiny_tokenizer(), read_documents(trained["corpus"]), 40, 12)
    assert f"{len(documents)}/{len(documents)}" in capsys.readouterr().err
    assert sorted(path.name for path in out.iterdir()) == ["metrics.json", "provenance.json"]
    record = json.loads((out / "metrics.json").read_text())["provenance"]
    assert record["arguments"]["dictionary"] == str(trained["root"] / "dictionary")
    assert record["arguments"]["format"] == "gradpatch" and record["arguments"]["corpus"] == str(trained["corpus"])
    assert record["command"] == ["gradpatch", *args, "--overwrite"]
    assert {"gradpatch", "torch", "transformers"} <= set(record["versions"])
    assert sorted(path.name for path in tmp_path.iterdir()) == ["eval"]  # no staging folder left
    assert cli.main([*args, "--overwrite", "--quiet"]) == 0
    assert f"{len(documents)}/{len(documents)}" not in capsys.readouterr().err


def test_eval_names_the_format_flag_for_a_folder_of_another_layout(trained: dict[str, Path], tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture) -> None:
    from gradpatch.dictionaries import export_saelens

    folder = tmp_path / "saelens"
    export_saelens(load_dictionary(trained["root"] / "dictionary", check_fingerprint=False), folder)
    assert cli.main(["dictionary", "eval", "--dictionary", str(folder), "--model", str(trained["model"]),
                     "--out", str(tmp_path / "eval")]) == 2
    err = capsys.readouterr().err
    assert "give --format saelens --node NODEPATH" in err and "load_saelens" not in err
    assert not (tmp_path / "eval").exists()


@pytest.mark.parametrize("case", ["empty", "missing", "node"])
def test_fit_refuses_bad_data_or_nodepath_with_status_2_before_lightning_writes(
        trained: dict[str, Path], tmp_path: Path, case: str, capsys: pytest.CaptureFixture) -> None:
    corpus, node = tmp_path / "corpus.txt", "model.layers_1.output"
    if case == "empty":
        corpus.write_text("")
    elif case == "node":
        corpus, node = trained["corpus"], "model.layers_9.output"
    config = {"trainer": {"accelerator": "cpu", "enable_progress_bar": False},
              "model": {"dictionary": {"node": node, "k": 4, "expansion_factor": 2}, "buffer_rows": 64},
              "data": {"corpus": str(corpus), "train_tokens": 64, "chunk_length": 16, "batch_size": 4,
                       "eval_tokens": 32, "max_length": 32}}
    (tmp_path / "sae.yaml").write_text(yaml.safe_dump(config))
    root = tmp_path / "run"
    assert cli.main(["fit", "--config", str(tmp_path / "sae.yaml"), "--model", str(trained["model"]),
                     "--trainer.default_root_dir", str(root)]) == 2
    expected = {"empty": "the corpus gives 0 tokens, fewer than one chunk of 16; give a longer corpus or a smaller "
                         "--data.chunk_length", "missing": "corpus file not found",
                "node": "NodePath 'model.layers_9.output' does not exist"}[case]
    assert "gradpatch fit: " in (err := capsys.readouterr().err) and expected in err and "Traceback" not in err
    assert not root.exists() and not (tmp_path / "lightning_logs").exists()
