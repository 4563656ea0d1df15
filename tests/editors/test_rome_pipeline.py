"""ROME end to end on tiny random models: keys, value objective, update, evaluation and the eval-rome command."""

from __future__ import annotations

import json

import pytest
import torch

from editors import (
    ROME,
    Corpus,
    EditRequest,
    ROMEConfig,
    ValueObjective,
    compute_key,
    editable_graph,
    evaluate_cases,
    load_cases,
    optimize_value,
    resolve_layer,
    restore_edits,
)
from editors.errors import EditError, StatisticsError, SubjectNotFoundError
from editors.evaluation.scores import score_case
from editors.passes.scoring import mean_target_logprobs
from editors.statistics.keys import context_activations, subject_first_activations
from gradpatch.testing import TOY_SENTENCES, byte_level_tokenizer, tiny_gpt2, tiny_llama

# Random tiny models barely move information between positions, so the toy fact ends with its subject: the
# edited value then reaches the next-token logits directly (real models need no such help).
CASE = {
    "case_id": 7,
    "requested_rewrite": {"prompt": "The river flows into the sea near {}", "subject": "the old town",
                          "target_new": {"str": "Rome"}, "target_true": {"str": "Paris"}, "relation_id": "P276"},
    "paraphrase_prompts": ["Because it rains, we stay home in the old town", "I think the bridge is in the old town"],
    "neighborhood_prompts": ["The capital of France is", "The Louvre is located in the city of"],
}


def _config(tmp_path) -> ROMEConfig:
    # Random tiny models have MLP outputs ~100x smaller than their residual stream, so the paper's clamp
    # (||δ|| <= 4 ||v₀||) would forbid any visible edit: loosen it.
    return ROMEConfig(n_samples=32, max_length=64, cache_dir=str(tmp_path), progress=False, steps=25,
                      clamp_factor=500.0, context_length_params=((5, 4), (10, 4)))


def _setup(kind: str):
    from gradpatch import PatchableGraph

    tok = byte_level_tokenizer()  # single-token " Rome"/" Paris"; BOS handling is covered in test_rome_tokens
    if kind == "llama":
        model = tiny_llama(len(tok))
        node = "model.layers_0.mlp.down_proj"  # an edit needs a later attention layer to reach the target
    else:
        model = tiny_gpt2(len(tok))
        node = "transformer.h_0.mlp.c_proj"
    pg = PatchableGraph(model, torch.randint(0, len(tok), (2, 6)), use_cache=False)
    return pg, tok, node


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_edit_writes_the_fact_and_restores(kind: str, tmp_path) -> None:
    pg, tok, node = _setup(kind)
    rome = ROME(pg, tok, node, _config(tmp_path), corpus=Corpus(name="toy", texts=list(TOY_SENTENCES) * 4))
    request = EditRequest.from_dict(CASE["requested_rewrite"])
    layer = resolve_layer(pg, node)
    original = layer.weight.detach().clone()
    forward = lambda ids: pg(ids, use_cache=False)  # noqa: E731
    tok = rome.tokenizer  # the texts as the editor reads them (after its start token)
    before = mean_target_logprobs(forward, tok, [request.text] * 2, [request.target_new, request.target_true])
    # every context's key and the subject-first key (the defaults solve for each), [P + 1, d_in]
    keys = torch.cat([context_activations(pg, tok, [layer.input_node], [(request.prompt, request.subject)],
                                          rome.templates())[0][0],
                      subject_first_activations(pg, tok, [layer.input_node], [request.subject])[0][0]])
    values = layer.forward_value(keys).detach()
    edit = rome.edit(request)
    # The update stores k* -> v* exactly (up to float32 rounding of the weight), and every solved key gains δ.
    v_star, delta = rome.last_value.v_star, rome.last_value.delta
    assert torch.allclose(layer.forward_value(keys.mean(dim=0)), v_star, atol=1e-3 * float(v_star.norm()) + 1e-4)
    torch.testing.assert_close(layer.forward_value(keys).detach() - values, delta.expand_as(values), rtol=0,
                               atol=1e-3 * float(delta.norm()) + 1e-4)
    after = mean_target_logprobs(forward, tok, [request.text] * 2, [request.target_new, request.target_true])
    assert after[0] > before[0] + 1.0  # the new target became much more likely
    assert after[0] > after[1]  # efficacy
    assert edit.info["steps"] <= 25 and len(rome.templates()) == 9
    # A second fact on top of the first; restoring both in reverse order gives back the original weights.
    second = rome.edit(EditRequest(prompt="I think the answer is {}", subject="the bridge", target_new="Paris"))
    assert second.model_fingerprint != edit.model_fingerprint  # computed on the model with the first edit
    with pytest.raises(EditError, match="restore later edits first"):
        edit.restore(pg)
    restore_edits(pg, [edit, second])
    assert torch.equal(layer.weight, original)


def test_value_objective_terms(tmp_path) -> None:
    pg, tok, node = _setup("llama")
    rome = ROME(pg, tok, node, _config(tmp_path), corpus=Corpus(name="toy", texts=list(TOY_SENTENCES) * 4))
    request = EditRequest(prompt="The capital of {} is", subject="France", target_new="London")
    layer = rome.layer
    key = compute_key(pg, tok, layer, request.prompt, request.subject, rome.templates())
    v0 = layer.forward_value(key).detach()
    objective = ValueObjective(pg, tok, layer, request, rome.templates(), v0)
    delta = torch.nn.Parameter(torch.zeros_like(v0))
    terms = objective.loss(delta)
    assert set(terms) == {"loss", "nll", "kl", "weight_decay", "target_prob"}
    assert float(terms["kl"].detach()) == pytest.approx(0.0, abs=1e-6)  # δ = 0: no drift yet
    assert objective.input_ids.shape[0] == len(rome.templates()) + 1  # rewriting prompts + "{s} is a"
    terms["loss"].backward()
    assert delta.grad is not None and delta.grad.norm() > 0
    model_params = list(pg._original.parameters())
    for p in model_params:
        p.grad = None
    result = optimize_value(objective, steps=2)  # the runner freezes the model: only δ gets gradients
    assert all(p.grad is None and p.requires_grad for p in model_params)
    assert result.steps <= 2 and len(result.history) >= 1
    assert torch.equal(result.v_star, v0 + result.delta)
    big = torch.full_like(v0, 1e3)
    objective.project_(big)
    assert float(big.norm()) == pytest.approx(objective.max_norm, rel=1e-5)


def test_failures_leave_weights_untouched(tmp_path) -> None:
    pg, tok, node = _setup("llama")
    rome = ROME(pg, tok, node, _config(tmp_path), corpus=Corpus(name="toy", texts=list(TOY_SENTENCES) * 4))
    layer = rome.layer
    original = layer.weight.detach().clone()
    flags = [p.requires_grad for p in pg._original.parameters()]
    with pytest.raises(SubjectNotFoundError):
        rome.edit(_bad_request())
    assert torch.equal(layer.weight, original)
    pg.train()
    with pytest.raises(EditError, match="pg.eval"):
        rome.edit(EditRequest(prompt="The capital of {} is", subject="France", target_new="London"))
    pg.eval()
    assert torch.equal(layer.weight, original)
    assert [p.requires_grad for p in pg._original.parameters()] == flags
    searches = []  # singular statistics fail before the value search, naming the node and the subject
    singular = ROME(pg, tok, node, _config(tmp_path), statistics=torch.zeros(layer.d_in, layer.d_in),
                    value_runner=lambda *args, **kwargs: searches.append(args))
    with pytest.raises(StatisticsError, match=f"{node}, subject 'France': The second moment is singular"):
        singular.edit(EditRequest(prompt="The capital of {} is", subject="France", target_new="London"))
    assert searches == [] and torch.equal(layer.weight, original)


def _bad_request() -> EditRequest:
    """A request that fails inside the edit (its prompt lost the "{}" placeholder after validation)."""
    request = EditRequest(prompt="The capital of {} is", subject="France", target_new="London")
    object.__setattr__(request, "prompt", "The capital of France is")  # no "{}" any more
    return request


def test_evaluate_cases_restores_between_cases(tmp_path) -> None:
    pg, tok, node = _setup("gpt2")
    rome = ROME(pg, tok, node, _config(tmp_path), corpus=Corpus(name="toy", texts=list(TOY_SENTENCES) * 4))
    original = rome.layer.weight.detach().clone()
    cases = load_cases([CASE, {**CASE, "case_id": 8}])
    metrics = evaluate_cases(pg, rome.tokenizer, cases, rome.compute, progress=False)
    assert metrics["n_cases"] == 2 and len(metrics["cases"]) == 2
    for key in ("efficacy_score", "paraphrase_score", "neighborhood_score"):
        assert 0.0 <= metrics[key] <= 1.0
    row = metrics["cases"][0]
    assert torch.equal(rome.layer.weight, original)
    # "pre" is the unedited model's score (which way a random model leans depends on the transformers release's
    # initialisation); the edit raised the new target's log-probability and made it win on the rewrite prompt
    unedited = score_case(pg, rome.tokenizer, cases[0])
    assert row["case_id"] == 7 and row["pre"]["efficacy"] == unedited["efficacy"] and row["efficacy"] == 1.0
    assert row["logp"]["post"]["new"]["rewrite"] > row["logp"]["pre"]["new"]["rewrite"]


#: The fields of eval-rome's JSON before it became an alias of ``eval-edit --method rome`` (what its users read).
EVAL_ROME_KEYS = {"efficacy_score", "paraphrase_score", "neighborhood_score", "n_cases", "pre", "node", "config",
                  "statistics", "seconds", "cases", "model"}
EVAL_ROME_CASE_KEYS = {"case_id", "subject", "prompt", "target_true", "target_new", "efficacy", "paraphrase",
                       "neighborhood", "pre", "logp", "edit", "seconds"}


def _leaves(record, prefix=""):
    """``{"a.b.0": leaf}`` of a JSON record."""
    if isinstance(record, dict):
        return {k: v for key, value in record.items() for k, v in _leaves(value, f"{prefix}{key}.").items()}
    if isinstance(record, list):
        return {k: v for i, value in enumerate(record) for k, v in _leaves(value, f"{prefix}{i}.").items()}
    return {prefix[:-1]: record}


def test_eval_rome_command(tmp_path) -> None:
    """``eval-rome`` is ``eval-edit --method rome``: eval-rome's JSON fields, and the values of ``evaluate_rome`` (the
    recipe it ran before, with the Lightning value runner) within 1e-5."""
    from gradpatch.files.loaders import load_model
    from recipes.cli import main
    from recipes.editing.rome_recipe import evaluate_rome
    from recipes.editing.rome_value import LightningValueRunner

    tok = byte_level_tokenizer()
    model = tiny_gpt2(len(tok))
    model_dir = tmp_path / "model"
    model.save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    cases_file = tmp_path / "cases.json"
    cases_file.write_text(json.dumps([CASE, {**CASE, "case_id": 8, "requested_rewrite": {
        **CASE["requested_rewrite"], "target_new": {"str": "Berlin"}}}]), encoding="utf-8")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(list(TOY_SENTENCES) * 4), encoding="utf-8")
    out = tmp_path / "metrics.json"
    status = main(["eval-rome", "--cases", str(cases_file), "--out", str(out), "--model", str(model_dir),
                   "--node", "transformer.h_0.mlp.c_proj", "--corpus", str(corpus), "--n-samples", "32",
                   "--cache-dir", str(tmp_path / "cache"), "--quiet"])
    assert status == 0
    metrics = json.loads(out.read_text())
    assert EVAL_ROME_KEYS <= set(metrics) and metrics["method"] == "rome"
    assert set(metrics["statistics"]) == {"n_tokens", "n_samples", "corpus"}
    assert {"statistics_and_templates", "cases", "load"} <= set(metrics["seconds"])
    assert metrics["n_cases"] == 2 and [row["case_id"] for row in metrics["cases"]] == [7, 8]
    assert all(EVAL_ROME_CASE_KEYS <= set(row) for row in metrics["cases"])
    assert metrics["node"] == "transformer.h_0.mlp.c_proj"

    loaded, tokenizer = load_model(str(model_dir), device="cpu")
    pg = editable_graph(loaded, tokenizer)
    rome = ROME(pg, tokenizer, metrics["node"], ROMEConfig(n_samples=32, cache_dir=str(tmp_path / "cache"),
                                                           progress=False),
                corpus=str(corpus), value_runner=LightningValueRunner())
    before = evaluate_rome(rome, load_cases(cases_file), progress=False)
    assert set(before) <= set(metrics)
    got, expected = _leaves(metrics), _leaves(before)
    timings = [key for key in expected if "seconds" in key or "timings_s" in key]
    assert len(timings) >= 5
    for key in sorted(set(expected) - set(timings)):
        if key.startswith("config."):
            continue  # eval-edit's configuration (allow_unconverged: every edit is scored, as before)
        if isinstance(expected[key], float):
            assert got[key] == pytest.approx(expected[key], abs=1e-5), key
        else:
            assert got[key] == expected[key], key
    assert main(["eval-rome", "--cases", str(cases_file), "--out", str(out), "--model", str(model_dir)]) == 2
