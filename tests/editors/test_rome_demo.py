"""The ROME demo end to end on the embedded SmolLM2-135M-Instruct, reduced (slow: loads the real model)."""

from __future__ import annotations

import json

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _events(folder) -> EventAccumulator:
    return EventAccumulator(str(folder), size_guidance={"scalars": 0, "images": 0, "tensors": 0}).Reload()


@pytest.mark.slow
def test_demo_with_two_cases(tmp_path, capsys) -> None:
    from demos.rome.demo import main

    out = tmp_path / "demo"
    # A small statistics sample in a private cache keeps the test short and the user's cache untouched.
    status = main(["--out", str(out), "--n-cases", "2", "--trace-samples", "1", "--n-samples", "150",
                   "--cache-dir", str(tmp_path / "cache"), "--device", "cpu", "--quiet"])
    printed = capsys.readouterr().out
    assert status == 0  # the edit succeeded: the rewrite prompt now continues with " Rome"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["edit"]["succeeded"] and summary["generations"][0]["after"].strip().startswith("Rome")
    assert summary["generations"][0]["before"].strip().startswith("Paris")
    assert summary["edit"]["probabilities"]["after"]["new"] > 0.5 > summary["edit"]["probabilities"]["before"]["new"]
    neighbours = [g for g in summary["generations"] if "Louvre" in g["prompt"]]
    assert neighbours and neighbours[0]["after"].strip().startswith("Paris")  # another Paris landmark stays
    assert summary["scores"]["n_cases"] == 2 and summary["scores"]["efficacy_score"] == 1.0
    metrics = json.loads((out / "metrics.json").read_text())
    assert len(metrics["cases"]) == 2 and 0.0 <= metrics["paraphrase_score"] <= 1.0
    assert (out / "edit" / "edit.safetensors").stat().st_size > 0 and (out / "edit" / "edit.json").exists()

    # Heatmaps: one PNG per kind, and the trace's numbers in JSON.
    for kind in ("hidden", "mlp", "attn"):
        png = out / "trace" / f"trace_{kind}.png"
        assert png.read_bytes()[:8] == PNG_SIGNATURE and png.stat().st_size > 10_000
    trace = json.loads((out / "trace" / "trace.json").read_text())
    assert trace["clean_prob"] > 0.5 > trace["corrupted_prob"]

    # TensorBoard: the trace images, and the edit's value optimisation with its generations.
    logdir = out / "tensorboard"
    assert f"tensorboard --logdir {logdir}" in printed
    trace_events = _events(logdir / "trace")
    assert {"causal_trace/hidden", "causal_trace/mlp", "causal_trace/attn"} <= set(trace_events.Tags()["images"])
    rome_events = _events(summary["tensorboard"]["rome_run"])
    losses = [e.value for e in rome_events.Scalars("loss/total")]
    assert len(losses) == summary["edit"]["steps"] and losses[-1] < losses[0]
    assert {"loss/kl", "prob/target", "edit/p_new_after"} <= set(rome_events.Tags()["scalars"])
    table = rome_events.Tensors("generations/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "Rome" in table and "Louvre" in table
