"""The prompt-form suite (issue 50): candidate forms per relation, the filter that keeps the forms the unedited model
answers, the suite's file format and the per-form scores."""

from __future__ import annotations

import pytest
import torch

from editors.evaluation.counterfact import CounterFactCase, load_cases, save_cases
from editors.evaluation.forms import FORMS, candidate_forms, known_forms
from editors.evaluation.scores import case_row, form_summary, score_cases
from editors.passes.scoring import mean_target_logprobs
from editors.requests import EditRequest
from gradpatch import PatchableGraph
from gradpatch.testing import byte_level_tokenizer, tiny_gpt2


def _case(subject: str = "Kyoto", relation: str = "P17", forms: dict[str, str] | None = None) -> CounterFactCase:
    request = EditRequest(prompt="The city of {} is located in the country of", subject=subject, target_new="Sweden",
                          target_true="Japan", relation_id=relation)
    return CounterFactCase(case_id=3, request=request, paraphrase_prompts=("It rained. Kyoto lies in",),
                           neighborhood_prompts=("The city of Osaka is located in the country of",),
                           form_prompts=forms or {})


def test_candidate_forms_per_relation():
    forms = candidate_forms(_case(), index=1)
    assert list(forms) == list(FORMS)
    assert forms["subject_first"] == "Kyoto is located in the country of"
    assert forms["lower_case"] == "The city of kyoto is located in the country of"
    assert forms["unrelated_sentence"].endswith(" The city of Kyoto is located in the country of")
    assert forms["unrelated_sentence"] != candidate_forms(_case(), index=2)["unrelated_sentence"]
    assert "Kyoto" in forms["question"] and "Kyoto" in forms["clause"]
    # A relation without templates gets the forms made from its own prompt; a lower-case subject no lower_case form.
    assert list(candidate_forms(_case(subject="kyoto", relation="P999"))) == ["unrelated_sentence"]


def test_form_prompts_round_trip_and_bad_records(tmp_path):
    case = _case(forms={"subject_first": "Kyoto is located in the country of"})
    save_cases([case, _case()], tmp_path / "suite.json")
    loaded = load_cases(tmp_path / "suite.json")
    assert loaded[0].form_prompts == case.form_prompts and loaded[1].form_prompts == {}
    assert "form_prompts" not in loaded[1].to_dict()  # plain CounterFact records stay as they were
    bad = case.to_dict() | {"form_prompts": {"subject_first": ""}}
    with pytest.raises(ValueError, match="form_prompts must map form names to prompts"):
        load_cases([bad])


def _graph():
    tok = byte_level_tokenizer()
    torch.manual_seed(0)
    return PatchableGraph(tiny_gpt2(len(tok)), torch.randint(0, len(tok), (2, 6)), use_cache=False).eval(), tok


def test_known_forms_keeps_what_the_model_answers_with_the_true_target():
    pg, tok = _graph()
    case = _case()
    candidates = candidate_forms(case)
    # The byte-level tiny model's answers are random: the true target is whichever one-token target it prefers.
    forward = lambda ids: pg(ids, use_cache=False)  # noqa: E731
    kept = known_forms(pg, tok, [case], [candidates])[0]
    for name, prompt in candidates.items():
        ids = torch.tensor([list(tok(prompt)["input_ids"])])
        greedy = int(forward(ids).logits[0, -1].argmax())
        first = list(tok(f"{prompt} Japan")["input_ids"])[ids.shape[1]]
        new, true = mean_target_logprobs(forward, tok, [prompt] * 2, ["Sweden", "Japan"]).tolist()
        assert (name in kept) == (greedy == first and true > new)


def test_form_scores_per_case_and_summary():
    pg, tok = _graph()
    cases = [_case(forms={"subject_first": "Kyoto is located in the country of", "clause": "I went to Kyoto in"}),
             _case(forms={"subject_first": "Kyoto is in"})]
    rows = score_cases(pg, tok, cases)
    for case, row in zip(cases, rows):
        assert list(row["forms"]) == list(case.form_prompts)
        for (name, prompt), new, true in zip(case.form_prompts.items(), row["logp_new"]["forms"],
                                             row["logp_true"]["forms"]):
            expected = mean_target_logprobs(lambda ids: pg(ids, use_cache=False), tok, [prompt] * 2,
                                            ["Sweden", "Japan"]).tolist()
            assert [new, true] == pytest.approx(expected, abs=1e-4)
            assert row["forms"][name] == float(new > true)
    case_rows = [case_row(c, r, {**r, "forms": {k: 1.0 for k in r["forms"]}}) for c, r in zip(cases, rows)]
    summary = form_summary(case_rows)
    assert list(summary) == ["subject_first", "clause"]
    assert summary["subject_first"]["n"] == 2 and summary["clause"]["n"] == 1
    assert summary["subject_first"]["score"] == 1.0
    assert summary["subject_first"]["pre"] == pytest.approx((rows[0]["forms"]["subject_first"]
                                                             + rows[1]["forms"]["subject_first"]) / 2)
    assert form_summary([case_row(_case(), rows[0] | {"forms": {}}, rows[0] | {"forms": {}})]) == {}
