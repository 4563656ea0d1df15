"""Verification of an estimate (``verify_top``): its top units patched exactly, the measured effects equal the whole
sweep's, the other units keep their estimates; ``exact_sweep(only=...)``; errors; ``gradpatch attribute --verify``."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from gradpatch.attribution import AttributionError, atp, atp_star, eap, exact_sweep, verify_top
from gradpatch.testing import random_prompt_batch

KW = {"use_cache": False}


def _key(score) -> tuple:
    return (score.node, score.position, score.head)


@pytest.mark.parametrize("direction", ["noise", "denoise"])
def test_the_top_units_get_the_whole_sweeps_scores_and_the_rest_keep_their_estimates(gpt2_graph, direction):
    batch = random_prompt_batch()
    nodes = ["heads", "mlp"]
    full = exact_sweep(gpt2_graph, batch, nodes, direction=direction, batch_size=15, forward_kwargs=KW)
    estimate = atp(gpt2_graph, batch, nodes, direction=direction, forward_kwargs=KW)
    verified = verify_top(gpt2_graph, batch, estimate, 7, batch_size=15, forward_kwargs=KW)
    assert verified.method == "atp+verify" and verified.direction == direction
    assert [_key(s) for s in verified.scores] == [_key(s) for s in estimate.scores]
    top = {_key(s) for s in sorted(estimate.scores, key=lambda s: -abs(s.score))[:7]}
    truth, guess = full.score_map(), estimate.score_map()
    assert {_key(s) for s in verified.scores if s.exact} == top
    for score in verified.scores:
        if score.exact:
            assert score.score == pytest.approx(truth[_key(score)], abs=1e-5)
        else:
            assert score.score == guess[_key(score)]
    assert any(abs(truth[key] - guess[key]) > 1e-3 for key in top)  # the verification changed something
    assert verified.forward > estimate.forward and verified.backward == estimate.backward
    assert all(s.exact for s in full.scores) and not any(s.exact for s in estimate.scores)


def test_verifying_every_unit_is_the_exact_sweep_and_graddrop_magnitudes_become_signed(llama_graph):
    batch = random_prompt_batch()
    full = exact_sweep(llama_graph, batch, "mlp", forward_kwargs=KW)
    magnitudes = atp_star(llama_graph, batch, "mlp", grad_drop=True, forward_kwargs=KW)
    verified = verify_top(llama_graph, batch, magnitudes, 10_000, forward_kwargs=KW)
    assert all(s.exact for s in verified.scores) and verified.method == "atp-star+verify"
    torch.testing.assert_close(torch.tensor([s.score for s in verified.scores]),
                               torch.tensor([s.score for s in full.scores]), atol=1e-5, rtol=1e-4)
    assert any(s.score < 0 for s in verified.scores)  # signed effects, where GradDrop gave magnitudes


def test_query_units_are_verified_per_head(llama_graph):
    batch = random_prompt_batch()
    full = exact_sweep(llama_graph, batch, "queries", positions=[3, 5], forward_kwargs=KW).score_map()
    estimate = atp_star(llama_graph, batch, "queries", positions=[3, 5], forward_kwargs=KW)
    verified = verify_top(llama_graph, batch, estimate, 3, forward_kwargs=KW)
    checked = [s for s in verified.scores if s.exact]
    assert len(checked) == 3 and all(s.head is not None for s in checked)
    for score in checked:
        assert score.score == pytest.approx(full[_key(score)], abs=1e-5)


def test_exact_sweep_of_chosen_units_and_bad_input(llama_graph, monkeypatch):
    batch = random_prompt_batch()
    chosen = [("model.layers_1.mlp.output", 4, None), ("model.layers_0.mlp.output", 2, None)]
    some = exact_sweep(llama_graph, batch, "mlp", positions=[2, 4], forward_kwargs=KW, only=chosen)
    assert [_key(s) for s in some.scores] == sorted(chosen)  # in the order of the whole sweep: node, then position
    full = exact_sweep(llama_graph, batch, "mlp", positions=[2, 4], forward_kwargs=KW).score_map()
    for score in some.scores:
        assert score.score == pytest.approx(full[_key(score)], abs=1e-5)
    estimate = atp(llama_graph, batch, "mlp", forward_kwargs=KW)
    other = random_prompt_batch(seed=1)
    with pytest.raises(AttributionError, match="clean metric is .* here but .* in the estimate"):
        verify_top(llama_graph, other, estimate, 2, forward_kwargs=KW)
    edges = eap(llama_graph, batch, forward_kwargs=KW)

    def no_forward(*args, **kwargs):
        raise AssertionError("a forward pass ran")

    monkeypatch.setattr(llama_graph, "forward", no_forward)
    with pytest.raises(AttributionError, match="k=0: verify at least 1 unit"):
        verify_top(llama_graph, batch, estimate, 0, forward_kwargs=KW)
    with pytest.raises(AttributionError, match="no node scores to verify"):
        verify_top(llama_graph, batch, edges, 3, forward_kwargs=KW)
    foreign = replace(estimate, scores=[replace(s, node=s.node.replace("layers_", "layers_7"))
                                        for s in estimate.scores])
    with pytest.raises(AttributionError, match="scores nodes this graph lacks, e.g. 'model.layers_7[01].mlp.output'"):
        verify_top(llama_graph, batch, foreign, 3, forward_kwargs=KW)
    with pytest.raises(AttributionError, match="not units of the nodes and positions given"):
        exact_sweep(llama_graph, batch, "mlp", positions=[2], forward_kwargs=KW, only=chosen)
    with pytest.raises(AttributionError, match="no units to patch"):
        exact_sweep(llama_graph, batch, "mlp", forward_kwargs=KW, only=[])


def test_attribute_verify_writes_measured_top_units(tmp_path, capsys):
    from gradpatch.testing import byte_level_tokenizer, tiny_gpt2
    from recipes import cli

    model_dir = tmp_path / "model"
    tok = byte_level_tokenizer()
    tiny_gpt2(len(tok), init_std=0.3).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"clean": "The capital of France is", "corrupted": "The capital of Spain is",
                                   "answer": " Paris", "foil": " Rome"}) + "\n", encoding="utf-8")
    args = ["attribute", "--prompts", str(prompts), "--nodes", "heads", "--model", str(model_dir), "--quiet"]
    assert cli.main([*args, "--method", "exact", "--out", str(tmp_path / "exact")]) == 0
    assert cli.main([*args, "--method", "atp", "--verify", "5", "--out", str(tmp_path / "verified")]) == 0
    printed = capsys.readouterr().out
    exact = {(n["node"], n["position"], n["head"]): n["score"]
             for n in json.loads((tmp_path / "exact" / "scores.json").read_text())["nodes"]}
    verified = json.loads((tmp_path / "verified" / "scores.json").read_text())
    measured = [n for n in verified["nodes"] if n["exact"]]
    assert verified["method"] == "atp+verify" and len(measured) == 5 and len(verified["nodes"]) == len(exact)
    for node in measured:
        assert node["score"] == pytest.approx(exact[(node["node"], node["position"], node["head"])], abs=1e-5)
    assert "(exact)" in printed
    assert cli.main([*args, "--method", "exact", "--verify", "5", "--out", str(tmp_path / "bad")]) == 2
    assert "--verify takes a count of at least 1 and an estimate of node scores" in capsys.readouterr().err
    assert cli.main([*args, "--method", "atp", "--verify", "0", "--out", str(tmp_path / "bad")]) == 2
    assert not (tmp_path / "bad").exists()
