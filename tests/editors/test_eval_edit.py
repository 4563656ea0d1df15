"""Batched and sequential evaluation (``editors.evaluation.sequential``) and the ``gradpatch eval-edit`` command."""

from __future__ import annotations

import json

import pytest
import torch

import editors.evaluation.sequential as evaluate_batches
from editors import load_cases, resolve_layer
from editors.evaluation.scores import mentions_subject, neighborhood_fraction, score_case, score_cases
from editors.evaluation.sequential import AppliedBatch, evaluate_sequential
from gradpatch import PatchableGraph
from gradpatch.testing import TOY_SENTENCES, byte_level_tokenizer, tiny_gpt2

NODE = "transformer.h_0.mlp.c_proj"


def _case(i: int, subject: str, target_new: str) -> dict:
    return {"case_id": i,
            "requested_rewrite": {"prompt": "I think the answer is {}", "subject": subject,
                                  "target_new": {"str": target_new}, "target_true": {"str": "Paris"}},
            "paraphrase_prompts": [f"Because it rains, we stay home in {subject}", f"I think {subject}"],
            "neighborhood_prompts": ["The capital of France is", "The Louvre is located in the city of"]}


CASES = [_case(i, s, t) for i, (s, t) in enumerate([("the old town", "Rome"), ("the bridge", "London"),
                                                     ("Madrid", "Rome"), ("the sea", "Berlin"), ("Spain", "Rome")])]


def _graph():
    tok = byte_level_tokenizer()
    return PatchableGraph(tiny_gpt2(len(tok)), torch.randint(0, len(tok), (2, 6)), use_cache=False).eval(), tok


def test_score_cases_batches_many_cases_like_one_at_a_time():
    pg, tok = _graph()
    cases = load_cases(CASES)
    together = score_cases(pg, tok, cases, batch_size=7)
    for case, row in zip(cases, together):
        alone = score_case(pg, tok, case)
        assert row["efficacy"] == alone["efficacy"] and row["neighborhood"] == alone["neighborhood"]
        for which in ("logp_new", "logp_true"):
            for group, values in alone[which].items():
                assert row[which][group] == pytest.approx(values, abs=1e-4)
    # A plain model (no PatchableGraph) is scored with full logits: the same numbers.
    plain = score_cases(pg.wrapped_model, tok, cases, batch_size=7)
    for row, other in zip(together, plain):
        for which in ("logp_new", "logp_true"):
            for group, values in row[which].items():
                assert other[which][group] == pytest.approx(values, abs=1e-4)


def test_groups_are_scored_after_all_their_batches_and_undone(monkeypatch):
    pg, tok = _graph()
    weight = resolve_layer(pg, NODE).weight
    original = weight.detach().clone()
    applied: list[list[str]] = []
    at_scoring: list[int] = []
    real = evaluate_batches.score_cases

    def score(pg_, tok_, cases):
        at_scoring.append(len(applied))
        return real(pg_, tok_, cases)

    def apply(requests):
        applied.append([r.subject for r in requests])
        with torch.no_grad():
            weight.add_(0.5)

        def undo():
            with torch.no_grad():
                weight.sub_(0.5)
            applied.pop()

        return AppliedBatch(undo=undo, facts=[{"steps": len(applied)} for _ in requests], info={"method": "fake"})

    monkeypatch.setattr(evaluate_batches, "score_cases", score)
    groups: list[int] = []
    result = evaluate_sequential(pg, tok, load_cases(CASES), apply, batch_size=2, sequential=2,
                                 after_group=lambda: groups.append(len(applied)), progress=False)
    # pre-scores with nothing applied; group 1 (batches of 2 + 2 cases) scored with 2 batches applied; group 2
    # (the last case) with 1; everything undone after each group.
    assert at_scoring == [0, 2, 1] and groups == [0, 0]
    assert [r["n_facts"] for r in result["batches"]] == [2, 2, 1] and len(result["seconds_per_batch"]) == 3
    assert [row["group"] for row in result["cases"]] == [0, 0, 0, 0, 1]
    assert [row["batch"] for row in result["cases"]] == [0, 0, 1, 1, 2]
    assert result["cases"][2]["edit"] == {"steps": 2}  # the second batch of its group
    assert result["n_cases"] == 5 and set(result["pre"]) == {"efficacy_score", "paraphrase_score",
                                                            "neighborhood_score"}
    torch.testing.assert_close(weight, original, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="at least 1"):
        evaluate_sequential(pg, tok, load_cases(CASES), apply, batch_size=0)


def test_mentions_subject_matches_whole_names_only():
    edited = mentions_subject(["Spain", "the sea", "Rio de Janeiro"])
    assert edited("The capital of Spain is") and edited("Ships cross the sea to") and edited("Rio de Janeiro, in")
    assert not edited("Spaniards live in") and not edited("In the season of") and not edited("The capital is")
    assert not mentions_subject([])("Spain")


def test_neighborhood_prompts_about_subjects_edited_in_the_group_are_left_out():
    pg, tok = _graph()
    records = [dict(record) for record in CASES]
    records[0] = dict(records[0], neighborhood_prompts=["Madrid is the capital of", "The capital of France is"])
    records[4] = dict(records[4], neighborhood_prompts=["The old town of Madrid is in", "Seville is in"])

    def apply(requests):
        return AppliedBatch(undo=lambda: None, facts=[{} for _ in requests])

    result = evaluate_sequential(pg, tok, load_cases(records), apply, batch_size=2, sequential=2, progress=False)
    rows = result["cases"]
    # Madrid (case 2) is edited in group 0 with case 0, so case 0's first neighbourhood prompt is not scored; case 4
    # is in group 1, where Madrid is not edited, so both of its prompts count.
    assert [row["neighborhood_left_out"] for row in rows] == [1, 0, 0, 0, 0]
    assert result["neighborhood_prompts_left_out"] == 1
    post = score_cases(pg, tok, load_cases(records))  # nothing was edited: the scores before and after agree
    assert rows[0]["neighborhood"] == neighborhood_fraction(post[0], [False, True]) == rows[0]["pre"]["neighborhood"]
    assert rows[4]["neighborhood"] == post[4]["neighborhood"]


@pytest.mark.parametrize("method, extra", [
    ("memit", ["--batch-size", "3", "--nodes", "transformer.h_0.mlp.c_proj,transformer.h_1.mlp.c_proj",
               "--value-dtype", "bfloat16", "--true-logit-weight", "0.5"]),
    ("alphaedit", ["--batch-size", "2", "--sequential", "2", "--nodes", "transformer.h_0.mlp.c_proj",
                   "--nullspace-threshold", "0.5", "--preserve", "PRESERVE", "--preserve-weight", "2",
                   "--subject-first-key", "--start-token", "none", "--early-stop-loss", "0.2"]),
    ("memit", ["--batch-size", "2", "--nodes", NODE, "--mom2-update-weight", "7", "--no-subject-first-key"]),
    ("rome", ["--batch-size", "2", "--sequential", "2", "--node", NODE]),
    ("rome", ["--node", NODE, "--no-keys-per-context", "--no-subject-first-key", "--no-kl-in-context"]),
    ("rome", ["--node", NODE, "--value-at-subject", "--skip-cases", "1"]),
])
def test_eval_edit_command(method, extra, tmp_path):
    from recipes.cli import main

    tok = byte_level_tokenizer()
    model_dir = tmp_path / "model"
    tiny_gpt2(len(tok)).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    cases_file = tmp_path / "cases.json"
    forms = [{"subject_first": f"{c['requested_rewrite']['subject']} is where I live", "clause": f"We went, late, to "
              f"{c['requested_rewrite']['subject']}"} for c in CASES]
    forms[1].pop("clause")  # a form some cases lack is scored over the cases that have it
    cases_file.write_text(json.dumps([c | {"form_prompts": f} for c, f in zip(CASES, forms)]), encoding="utf-8")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(list(TOY_SENTENCES) * 4), encoding="utf-8")
    out = tmp_path / "metrics.json"
    preserve = tmp_path / "preserve.json"
    preserve.write_text(json.dumps([{"prompt": "We walked to {} at noon", "subject": s} for s in ("the park", "Lyon")]))
    extra = [str(preserve) if arg == "PRESERVE" else arg for arg in extra]
    status = main(["eval-edit", "--method", method, "--cases", str(cases_file), "--out", str(out), "--model",
                   str(model_dir), "--corpus", str(corpus), "--n-samples", "32", "--steps", "3", "--n-cases", "4",
                   "--cache-dir", str(tmp_path / "cache"), "--quiet", *extra])
    assert status == 0
    metrics = json.loads(out.read_text())
    assert {"efficacy_score", "paraphrase_score", "neighborhood_score", "n_cases", "pre", "cases", "batches",
            "seconds_per_batch"} <= set(metrics)
    assert metrics["n_cases"] == 4 and metrics["method"] == method
    skip = int(extra[extra.index("--skip-cases") + 1]) if "--skip-cases" in extra else 0
    assert [c["case_id"] for c in metrics["cases"]] == [skip, skip + 1, skip + 2, skip + 3]
    assert all(0.0 <= metrics[k] <= 1.0 for k in ("efficacy_score", "paraphrase_score", "neighborhood_score"))
    assert all(row["edit"]["steps"] is not None for row in metrics["cases"])
    assert list(metrics["forms"]) == ["subject_first", "clause"]  # each form's score beside the overall ones
    assert metrics["forms"]["subject_first"]["n"] == 4 and metrics["forms"]["clause"]["n"] == 3
    for name, form in metrics["forms"].items():
        having = [row for row in metrics["cases"] if name in row["forms"]]
        assert form["score"] == pytest.approx(sum(row["forms"][name] for row in having) / len(having))
        assert form["pre"] == pytest.approx(sum(row["pre"]["forms"][name] for row in having) / len(having))
    expected = {"file": str(preserve), "n_facts": 2, "weight": 2.0} if "--preserve" in extra else None
    assert metrics["preserved"] == expected
    settings = metrics["settings"]
    per_context = ("--no-keys-per-context" not in extra) if method == "rome" else ("--keys-per-context" in extra)
    first = ("--subject-first-key" in extra) if method == "alphaedit" else ("--no-subject-first-key" not in extra)
    assert settings["keys"].startswith("per context" if per_context else "averaged")  # the methods' defaults
    assert metrics["config"]["subject_first_key"] is first and settings["keys"].endswith("start of the text") is first
    assert settings["start_token"] == (None if "--start-token" in extra else "<|endoftext|>")  # every method's: auto
    if method == "rome":
        assert metrics["config"]["value_through_update"] is ("--value-at-subject" not in extra)
        assert metrics["config"]["kl_in_context"] is ("--no-kl-in-context" not in extra)  # ROME's default: on
        assert all(set(row["edit"]["rewrite"]) == {"logp_new", "logp_true", "wins"} for row in metrics["cases"])
        assert "mom2_update_weight" not in settings
    else:
        assert metrics["config"]["true_logit_weight"] == (0.5 if "--true-logit-weight" in extra else 0.0)
    default_stop = 0.15 if method == "alphaedit" else 0.05
    assert metrics["config"]["early_stop_loss"] == (0.2 if "--early-stop-loss" in extra else default_stop)
    if method == "memit":  # λ as resolved, per edited layer and batch
        weights = settings["mom2_update_weight"]
        nodes = metrics["nodes"]
        assert sorted(weights["per_layer_per_batch"]) == sorted(nodes)
        assert all(len(v) == len(metrics["batches"]) for v in weights["per_layer_per_batch"].values())
        values = [w for v in weights["per_layer_per_batch"].values() for w in v]
        if "--mom2-update-weight" in extra:
            assert weights["rule"] == "absolute" and weights["relative_weight"] is None and set(values) == {7.0}
        else:
            assert weights["rule"] == "relative" and weights["relative_weight"] == metrics["config"][
                "mom2_relative_weight"]
            assert len(set(values)) == len(values) and all(v > 0 for v in values)  # one λ per batch and layer
    elif method == "alphaedit":
        assert "mom2_update_weight" not in settings
    if method != "rome":
        assert metrics["config"]["kl_in_context"] is False  # MEMIT's and AlphaEdit's default: the paper's KL prompt


def test_eval_edit_refuses_bad_arguments(tmp_path, capsys):
    from recipes.cli import main

    cases_file = tmp_path / "cases.json"
    cases_file.write_text(json.dumps(CASES), encoding="utf-8")
    out = str(tmp_path / "m.json")
    assert main(["eval-edit", "--method", "memit", "--cases", str(cases_file), "--out", out, "--model", "x"]) == 2
    assert "--model needs --nodes" in capsys.readouterr().err
    assert main(["eval-edit", "--method", "rome", "--cases", str(cases_file), "--out", out, "--nodes", "a,b"]) == 2
    assert "ROME edits one layer" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{**CASES[0], "requested_rewrite": {**CASES[0]["requested_rewrite"],
                                                                   "prompt": "I think the answer is"}}]))
    assert main(["eval-edit", "--method", "memit", "--cases", str(bad), "--out", out]) == 2
    assert "Case 0 (record 0)" in capsys.readouterr().err
    assert main(["eval-edit", "--method", "rome", "--cases", str(cases_file), "--out", out, "--skip-cases", "-1"]) == 2
    assert "--skip-cases must be 0 or more" in capsys.readouterr().err
    assert main(["eval-edit", "--method", "rome", "--cases", str(cases_file), "--out", out, "--skip-cases", "5"]) == 2
    assert "--skip-cases 5 leaves none of the 5 cases" in capsys.readouterr().err
    assert main(["eval-edit", "--method", "rome", "--cases", str(cases_file), "--out", out, "--preserve", "p"]) == 2
    assert "--preserve applies to MEMIT and AlphaEdit" in capsys.readouterr().err
    for method in ("rome", "memit"):
        assert main(["eval-edit", "--method", method, "--cases", str(cases_file), "--out", out,
                     "--nullspace-threshold", "0.01"]) == 2
        assert "--nullspace-threshold is AlphaEdit's" in capsys.readouterr().err
    unfit = tmp_path / "preserve.json"
    unfit.write_text(json.dumps([{"prompt": "We walked to {}", "subject": "Lyon"},
                                 {"prompt": "No slot", "subject": "x"}]))
    assert main(["eval-edit", "--method", "memit", "--cases", str(cases_file), "--out", out, "--preserve",
                 str(unfit)]) == 2
    assert "record 1 needs a \"prompt\" with {}" in capsys.readouterr().err
    assert main(["eval-edit", "--method", "memit", "--cases", str(cases_file), "--out", out, "--preserve",
                 str(unfit), "--preserve-weight", "0"]) == 2
    assert "--preserve-weight must be positive" in capsys.readouterr().err
    assert main(["eval-edit", "--method", "rome", "--cases", str(cases_file), "--out", out, "--true-logit-weight",
                 "0.5"]) == 2
    assert "--true-logit-weight applies to MEMIT and AlphaEdit" in capsys.readouterr().err
    assert main(["eval-edit", "--method", "memit", "--cases", str(cases_file), "--out", out, "--true-logit-weight",
                 "-1"]) == 2
    err = capsys.readouterr().err  # the configuration's check (MEMITConfig), naming the option
    assert "true_logit_weight must be 0 or positive" in err and "--true-logit-weight" in err
    assert main(["eval-edit", "--method", "alphaedit", "--cases", str(cases_file), "--out", out, "--early-stop-loss",
                 "-1"]) == 2
    assert "early_stop_loss must be 0 (run every step) or positive, got -1" in capsys.readouterr().err
    assert main(["eval-edit", "--method", "memit", "--cases", str(cases_file), "--out", out,
                 "--mom2-relative-weight", "0"]) == 2
    assert "mom2_relative_weight must be positive" in capsys.readouterr().err
