"""`gradpatch attribute`: scores.json (atomic), heatmaps and a TensorBoard run from a JSONL file; usage errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from recipes import cli

LINES = [
    {"clean": "The capital of France is", "corrupted": "The capital of Spain is", "answer": " Paris", "foil": " Rome"},
    {"clean": "The capital of Spain is", "corrupted": "The capital of France is", "answer": " Rome", "foil": " Paris"},
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from gradpatch.testing import byte_level_tokenizer, tiny_gpt2

    path = tmp_path_factory.mktemp("model")
    tok = byte_level_tokenizer()
    tiny_gpt2(len(tok), init_std=0.3).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def _prompts(tmp_path: Path, lines: list[dict]) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n", encoding="utf-8")
    return path


@pytest.mark.parametrize("method", ["exact", "atp", "atp-ig", "atp-star"])
def test_attribute_writes_scores_heatmaps_and_tensorboard(model_dir, tmp_path, method, capsys):
    out = tmp_path / "run"
    status = cli.main(["attribute", "--prompts", str(_prompts(tmp_path, LINES)), "--method", method, "--nodes", "all",
                       "--out", str(out), "--model", str(model_dir), "--batch-size", "8", "--quiet"])
    assert status == 0, capsys.readouterr().err
    scores = json.loads((out / "scores.json").read_text())
    assert scores["method"] == method and scores["direction"] == "noise"
    assert set(scores["metric"]) == {"clean", "corrupted"} and set(scores["passes"]) == {"forward", "backward"}
    # tiny GPT-2: 2 layers, 4 heads, 6 positions: resid 12 + heads 48 + mlp 12 units
    assert len(scores["nodes"]) == 72
    heads = [n for n in scores["nodes"] if n["kind"] == "heads"]
    assert {n["head"] for n in heads} == {0, 1, 2, 3}
    assert all(n["head"] is None for n in scores["nodes"] if n["kind"] != "heads")
    assert {n["position"] for n in scores["nodes"]} == set(range(6))
    last = next(n for n in scores["nodes"] if n["node"] == "transformer.h_1.output" and n["position"] == 5)
    if method == "exact":  # the last block's output at the last position carries the whole corrupted run
        assert last["score"] == pytest.approx(scores["metric"]["corrupted"] - scores["metric"]["clean"], abs=1e-4)
        # 72 units, 12 per position, 4 variants of 2 prompts per pass: 2 recordings, 1 check of the shared blocks,
        # 1 pass filling the KV cache, 3 checks of it (from positions 1, 2 and 5: one per class of sizes), 3 passes
        # per position
        assert scores["passes"] == {"forward": 2 + 1 + 1 + 3 + 18, "backward": 0}
    elif method == "atp-ig":  # the default 5 steps: the corrupted run, then 5 forward and backward passes
        assert scores["passes"] == {"forward": 1 + 5, "backward": 5}
    else:
        assert scores["passes"] == {"forward": 2, "backward": 1}
    for kind in ("resid", "heads", "mlp"):
        assert (out / f"heatmap_{kind}.png").read_bytes()[:4] == b"\x89PNG"
    assert any((out / "tensorboard").glob("events.out.tfevents.*"))
    assert not list(tmp_path.glob(".run.*"))  # no staging folder left behind


def test_attribute_usage_errors_write_nothing(model_dir, tmp_path, capsys):
    out = tmp_path / "run"
    bad_length = [LINES[0], {**LINES[1], "clean": "The capital of Rome is", "corrupted": "The capital of Rome is"}]
    args = ["attribute", "--out", str(out), "--model", str(model_dir), "--quiet", "--prompts"]
    assert cli.main([*args, str(_prompts(tmp_path, bad_length))]) == 2
    assert "line 2 is 5 tokens but line 1 is 6" in capsys.readouterr().err
    assert cli.main([*args, str(_prompts(tmp_path, [{**LINES[0], "foil": " London"}]))]) == 2
    assert "the foil ' London' is 4 tokens" in capsys.readouterr().err
    assert cli.main([*args, str(_prompts(tmp_path, LINES)), "--nodes", "attn"]) == 2
    assert "unknown node kind or NodePath 'attn'" in capsys.readouterr().err
    (tmp_path / "bad.jsonl").write_text("{not json\n", encoding="utf-8")
    assert cli.main([*args, str(tmp_path / "bad.jsonl")]) == 2
    assert "line 1 is not JSON" in capsys.readouterr().err
    assert not out.exists()


def test_attribute_eap_ig_writes_edges_and_the_faithfulness_curve(tmp_path, capsys):
    from gradpatch.testing import metaspace_tokenizer, tiny_llama

    model_dir = tmp_path / "llama"
    tok = metaspace_tokenizer()
    tiny_llama(len(tok), init_std=0.3).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    lines = [{"clean": "The capital of France is", "corrupted": "The capital of Spain is", "answer": " France",
              "foil": " Spain"}]
    ids = [tok(line[key]).input_ids for line in lines for key in ("clean", "corrupted")]
    assert len(ids[0]) == len(ids[1]), ids
    out = tmp_path / "run"
    status = cli.main(["attribute", "--prompts", str(_prompts(tmp_path, lines)), "--method", "eap-ig", "--steps", "2",
                       "--out", str(out), "--model", str(model_dir), "--quiet"])
    assert status == 0, capsys.readouterr().err
    scores = json.loads((out / "scores.json").read_text())
    assert scores["method"] == "eap-ig" and scores["nodes"] == [] and scores["passes"]["backward"] == 2
    assert {"upstream", "downstream", "score"} == set(scores["edges"][0]) and len(scores["edges"]) == 82
    curve = scores["faithfulness"]
    assert curve[0]["k"] == 0 and curve[0]["faithfulness"] == pytest.approx(0.0, abs=1e-3)
    assert curve[-1]["k"] == 82 and curve[-1]["faithfulness"] == pytest.approx(1.0, abs=1e-3)
    assert (out / "faithfulness.png").read_bytes()[:4] == b"\x89PNG"


def test_attribute_help_lists_every_option(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["attribute", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for option in ("--prompts", "--method", "--nodes", "--out", "--batch-size", "--model", "--direction", "--steps",
                   "--grad-drop", "--verify", "exact", "atp-star", "eap-ig"):
        assert option in out, option


def test_save_attribution_publishes_all_files_or_none(tmp_path, monkeypatch):
    from gradpatch.attribution import AttributionResult, NodeScore
    from recipes.reports import attribution_report

    result = AttributionResult("atp", "noise", 1.0, -1.0, forward=2, backward=1, scores=[
        NodeScore("model.layers_0.mlp.output", p, None, 0.1 * p, "mlp", 0) for p in range(3)])
    out = tmp_path / "run"
    out.mkdir()
    (out / "scores.json").write_text("old", encoding="utf-8")
    (out / "notes.txt").write_text("kept", encoding="utf-8")

    def broken(*args, **kwargs):
        raise RuntimeError("plotting failed")

    monkeypatch.setattr(attribution_report, "plot_grid", broken)
    with pytest.raises(RuntimeError, match="plotting failed"):
        attribution_report.save_attribution(result, out, tensorboard=False)
    assert (out / "scores.json").read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["run"]
    monkeypatch.undo()
    written = attribution_report.save_attribution(result, out, tensorboard=False)
    assert json.loads((out / "scores.json").read_text())["nodes"][2]["score"] == pytest.approx(0.2)
    assert (out / "notes.txt").read_text() == "kept" and written["mlp"] == out / "heatmap_mlp.png"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
