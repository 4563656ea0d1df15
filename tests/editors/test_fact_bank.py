"""The fact bank (demos/rome/facts.json, facts_dev.json) and its builder: CounterFact structure, one subject per fact,
dev and evaluation splits apart, and (slow) a sample still verified against SmolLM2; the cities to preserve
(demos/rome/preserve.json) named in no bank."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from demos.rome.build_facts import RELATIONS, Candidate, build_cases
from demos.rome.build_preserve import BANKS, preserved_cities
from demos.rome.split_facts import split_by_subject
from demos.rome.verify_cases import verify_case
from editors import load_cases

BANK = Path(__file__).resolve().parents[2] / "demos" / "rome"


def test_bank_structure_and_splits():
    test, dev = load_cases(BANK / "facts.json"), load_cases(BANK / "facts_dev.json")
    assert len(test) >= 1000 and len(dev) >= 100
    for cases in (test, dev):
        subjects = [c.request.subject for c in cases]
        assert len(set(subjects)) == len(subjects)  # a batch of the whole file has no conflicting subjects
        assert [c.case_id for c in cases] == list(range(len(cases)))
        for case in cases:
            request = case.request
            assert request.relation_id in RELATIONS and request.prompt == RELATIONS[request.relation_id].prompt
            assert request.target_new != request.target_true
            assert len(case.paraphrase_prompts) == 2 and all(request.subject in p for p in case.paraphrase_prompts)
            assert len(case.neighborhood_prompts) == 2
            assert not any(request.subject in p for p in case.neighborhood_prompts)
    assert not {c.request.subject for c in test} & {c.request.subject for c in dev}


def test_test_split_is_the_committed_half_of_facts_json():
    bank = json.loads((BANK / "facts.json").read_text(encoding="utf-8"))
    dev2 = json.loads((BANK / "facts_dev2.json").read_text(encoding="utf-8"))
    test = json.loads((BANK / "facts_test.json").read_text(encoding="utf-8"))
    assert (dev2, test) == split_by_subject(bank, seed=0)  # the committed files are what the script writes
    assert len(test) >= 1000
    subjects = [{c["requested_rewrite"]["subject"] for c in part} for part in (dev2, test)]
    assert not subjects[0] & subjects[1] and len(subjects[0]) + len(subjects[1]) == len(bank)
    relations = [sorted({c["requested_rewrite"]["relation_id"] for c in part}) for part in (dev2, test)]
    assert relations[0] == relations[1]


def test_split_by_subject_refuses_a_repeated_subject():
    case = {"requested_rewrite": {"subject": "Lyon", "relation_id": "P17"}}
    with pytest.raises(ValueError, match="share the subject 'Lyon'"):
        split_by_subject([case, case])


def test_build_cases_neighbours_share_the_object():
    known = [Candidate("P17", city, country) for city, country in (
        ("Lyon", "France"), ("Marseille", "France"), ("Toulouse", "France"), ("Osaka", "Japan"), ("Kyoto", "Japan"),
        ("Nagoya", "Japan"), ("Lagos", "Nigeria"))] + [Candidate("P1376", "Paris", "France")]
    objects = {"P17": ["France", "Japan", "Nigeria"], "P1376": ["France", "Japan"]}
    cases = build_cases(known, objects, seed=0)
    by_subject = {c.request.subject: c for c in cases}
    assert "Lagos" not in by_subject  # no other Nigerian city: no neighbourhood prompts
    lyon = by_subject["Lyon"]
    assert lyon.request.target_new in ("Japan", "Nigeria")
    assert {p.split("The city of ")[1].split(" is")[0] for p in lyon.neighborhood_prompts} <= {"Marseille", "Toulouse"}
    # A capital's neighbours are other cities of its country, asked with the city -> country prompt.
    assert all(p.startswith("The city of ") and "located in the country of" in p
               for p in by_subject["Paris"].neighborhood_prompts)
    assert all(p.split(". ", 1)[1].count("Lyon") == 1 for p in lyon.paraphrase_prompts)  # prefix sentence first


def test_preserved_cities_are_named_in_no_bank():
    records = json.loads((BANK / "preserve.json").read_text(encoding="utf-8"))
    text = "".join((BANK / name).read_text(encoding="utf-8") for name in BANKS)
    subjects = [r["subject"] for r in records]
    assert len(records) == 1000 and len(set(subjects)) == len(subjects)
    assert all(r["prompt"] == RELATIONS["P17"].prompt and r["subject"] not in text for r in records)
    found = [Candidate("P17", "Lyon", "France"), Candidate("P17", "Osaka", "Japan"),
             Candidate("P1376", "Paris", "France"), Candidate("P17", "Nagoya", "Japan")]
    drawn = preserved_cities(found, "The city of Osaka is located in", n=2, seed=0)
    assert sorted(r["subject"] for r in drawn) == ["Lyon", "Nagoya"]  # Osaka is named, Paris is a capital (P1376)
    with pytest.raises(ValueError, match="only 2 cities"):
        preserved_cities(found, "Osaka", n=3, seed=0)


@pytest.mark.slow
def test_a_sample_of_the_bank_is_known_to_smollm2(smollm2):
    model, tokenizer = smollm2
    cases = load_cases(BANK / "facts.json")
    for case in random.Random(0).sample(cases, 12):
        row = verify_case(model, tokenizer, case)
        assert row["ok"], row["problems"]
