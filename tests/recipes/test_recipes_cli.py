"""`gradpatch fit`: LightningCLI over DeltaModule from YAML configs; `gradpatch graph` still registered."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from gradpatch import Intervention, PatchableGraph
from recipes import cli
from recipes.cli.fit import translate_model_shortcut
from recipes.testing import save_tiny_backbone

CONFIGS = Path(__file__).resolve().parents[2] / "recipes" / "configs"


def test_subcommands_are_registered():
    parser = cli.build_parser()
    names = [command.NAME for command in cli.COMMANDS]
    assert "graph" in names and "fit" in names
    args = parser.parse_args(["fit", "--config", "x.yaml", "--trainer.max_steps", "3", "-h"])
    assert args.lightning_args == ["--config", "x.yaml", "--trainer.max_steps", "3", "-h"]
    assert parser.parse_args(["graph", "--depth", "2"]).depth == 2


@pytest.mark.parametrize("command, options", [
    ("graph", ("--model", "--depth", "--node")),
    ("rome", ("--subject", "--prompt", "--target-new", "--model", "--node", "--device", "--logdir", "--save")),
    ("eval-rome", ("--cases", "--out", "--model", "--node", "--device", "--n-cases")),
    ("eval-edit", ("--method", "--cases", "--out", "--nodes", "--batch-size", "--sequential", "--n-cases", "--device")),
    ("trace", ("--subject", "--prompt", "--model", "--out", "--samples", "--logdir")),
])
def test_every_subcommand_has_help(command, options, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main([command, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for option in options:
        assert option in out, option


def test_fit_help(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["fit", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "gradpatch fit" in out
    for option in ("--config", "--model.model_path", "--model.deltas", "--model.objective.targets",
                   "--model.objective.kl_weight", "--trainer.max_steps", "--export"):
        assert option in out, option
    assert "--optimizer " not in out  # the optimizer is DeltaModule's, over the deltas only


def test_model_shortcut(tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"")
    assert translate_model_shortcut(["--model", str(tmp_path), "--x"]) == ["--model.model_path", str(tmp_path), "--x"]
    assert translate_model_shortcut([f"--model={gguf}"]) == ["--model.model_path", str(gguf)]
    assert translate_model_shortcut(["--model", "cfg.yaml"]) == ["--model", "cfg.yaml"]


@pytest.mark.parametrize("name", ["steer_eiffel.yaml", "steer_sentiment.yaml"])
def test_shipped_configs_parse(name, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["fit", "--config", str(CONFIGS / name), "--print_config"])
    assert exit_info.value.code == 0
    config = yaml.safe_load(capsys.readouterr().out)
    assert config["model"]["model_path"] is None
    assert config["model"]["deltas"] and config["trainer"]["max_steps"] > 0
    objective = config["model"]["objective"]
    assert objective["targets"] or (objective["steer_prompts"] and (objective["towards"] or objective["away"]))


def test_fit_from_yaml_on_a_model_directory(tmp_path, capsys):
    torch.set_num_threads(1)
    model_dir = save_tiny_backbone(tmp_path / "tiny")
    config = {
        "trainer": {"max_steps": 6, "accelerator": "cpu", "enable_progress_bar": False,
                    "logger": {"class_path": "lightning.pytorch.loggers.TensorBoardLogger",
                               "init_args": {"save_dir": str(tmp_path / "runs"), "name": "tiny"}}},
        "model": {"deltas": [{"node": "model.layers_1.output", "position": "last"}],
                  "objective": {"targets": [{"prompt": "the city of", "target": " Rome"}], "kl_prompts": ["the dog"]},
                  "lr": 0.1},
    }
    config_path = tmp_path / "tiny.yaml"
    config_path.write_text(yaml.safe_dump(config))
    assert cli.main(["fit", "--config", str(config_path), "--model", str(model_dir), "--model.lr", "0.2"]) == 0

    run = tmp_path / "runs" / "tiny" / "version_0"
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["model"]["model_path"] == str(model_dir) and saved["model"]["lr"] == 0.2
    assert any(p.name.startswith("events.out.tfevents") for p in run.iterdir())  # InterventionLogger added
    (checkpoint,) = (run / "checkpoints").iterdir()
    assert list(torch.load(checkpoint, weights_only=True)["state_dict"]) == ["intervention.values.0"]
    document = json.loads((run / "intervention" / "intervention.json").read_text())
    assert [record["path"] for record in document["patches"]] == ["model.layers_1.output"]
    assert "intervention saved to" in capsys.readouterr().err

    from gradpatch.files.loaders import load_model

    model, tokenizer = load_model(model_dir)
    ids = tokenizer("the city of", return_tensors="pt").input_ids
    pg = PatchableGraph(model, ids, use_cache=False)
    intervention = Intervention.load(run / "intervention", graph=pg, model=model)
    with torch.no_grad(), pg.patch(intervention):
        patched = pg(ids, use_cache=False).logits[0, -1]
    assert patched.argmax().item() == tokenizer("Rome").input_ids[0]


def test_graph_command_draws_a_subtree_and_names_unknown_nodes(tmp_path, capsys):
    model_dir = save_tiny_backbone(tmp_path / "tiny")
    assert cli.main(["graph", "--model", str(model_dir), "--node", "model.layers_0.mlp", "--depth", "1",
                     "--prompt", "the city of"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith("mlp") and "down_proj" in out and "weight" not in out
    assert cli.main(["graph", "--model", str(model_dir), "--node", "model.layers_0.mlpp"]) == 2
    assert "Closest valid NodePaths: model.layers_0.mlp" in capsys.readouterr().err


def test_rome_command_exits_1_on_an_unconverged_edit_and_saves_nothing(tmp_path, capsys):
    from gradpatch.testing import TOY_SENTENCES, byte_level_tokenizer, tiny_gpt2

    tok = byte_level_tokenizer()
    model_dir = tmp_path / "model"
    tiny_gpt2(len(tok)).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(list(TOY_SENTENCES) * 4), encoding="utf-8")
    save = tmp_path / "edit"
    status = cli.main(["rome", "--model", str(model_dir), "--node", "transformer.h_0.mlp.c_proj", "--subject",
                       "the old town", "--prompt", "I think the answer is {}", "--target-new", "Rome", "--corpus",
                       str(corpus), "--n-samples", "32", "--steps", "1", "--cache-dir", str(tmp_path / "cache"),
                       "--logdir", str(tmp_path / "runs"), "--save", str(save), "--quiet"])
    assert status == 1  # one step: its last loss is its first, so the search did not converge
    assert "did not converge" in capsys.readouterr().err
    assert not save.exists()
