"""Build the ReFT and BiPO evaluation sets from data the project ships (nothing downloaded).

- ``benchmarks/data/loreft_country_{train,eval}.jsonl``: ``{"prompt", "response"}``: "Which country is the city of
  X in? Answer in one word." -> " <country>" for the cities of ``demos/rome/facts.json`` (CounterFact-format
  records, true country ``target_true``). Train and eval cities are disjoint; the eval answers are countries seen in
  training (the task is the answer format, on entities not seen in training).
- ``benchmarks/data/bipo_sentiment_{train,eval}.jsonl``: ``{"prompt", "chosen", "rejected"}``: opinion prompts about
  topics, a positive (chosen) and a negative (rejected) short continuation from fixed word lists; train and eval
  topics are disjoint.

    python -m benchmarks.interventions.build_reft_data
"""

from __future__ import annotations

import json
import random
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FACTS = ROOT / "demos" / "rome" / "facts.json"
POSITIVE = ["wonderful", "great", "delightful", "excellent", "lovely", "brilliant", "fantastic", "beautiful",
            "amazing", "pleasant", "superb", "joyful"]
NEGATIVE = ["terrible", "awful", "horrible", "dreadful", "boring", "disappointing", "miserable", "ugly",
            "unpleasant", "bad", "disgusting", "painful"]
TOPICS_TRAIN = ["the movie", "the restaurant", "the concert", "the hotel", "the book", "the weather", "the game",
                "the trip", "the party", "the museum", "the lecture", "the park", "the coffee", "the show",
                "the city", "the meal", "the song", "the beach", "the train ride", "the new phone"]
TOPICS_EVAL = ["the play", "the garden", "the festival", "the painting", "the hike", "the album", "the class",
               "the dinner", "the wedding", "the ferry"]
TEMPLATES = ["I went to see {} yesterday. Honestly, it was", "My friend asked me about {}. I told her it was",
             "Here is my review of {}: it was"]


def _write(path: Path, records: list[dict[str, str]]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")


def country_records() -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """(train, eval) continuation records; 96 train and 64 eval cities with single-word countries."""
    facts = json.loads(FACTS.read_text(encoding="utf-8"))
    seen: set[str] = set()
    rows = []
    for fact in facts:
        rewrite = fact["requested_rewrite"]
        city, country = rewrite["subject"], rewrite["target_true"]["str"]
        if rewrite["relation_id"] != "P17" or city in seen or " " in country:
            continue
        seen.add(city)
        rows.append({"prompt": f"Which country is the city of {city} in? Answer in one word.\n",
                     "response": f"{country}"})
    random.Random(0).shuffle(rows)
    train = rows[:96]
    countries = {r["response"] for r in train}
    held_out = [r for r in rows[96:] if r["response"] in countries][:64]
    return train, held_out


def sentiment_records(topics: list[str], seed: int) -> list[dict[str, str]]:
    """One record per topic and template: a positive and a negative continuation."""
    rng = random.Random(seed)
    return [{"prompt": template.format(topic), "chosen": f" {rng.choice(POSITIVE)}.",
             "rejected": f" {rng.choice(NEGATIVE)}."} for topic in topics for template in TEMPLATES]


def main() -> None:
    out = ROOT / "benchmarks" / "data"
    out.mkdir(exist_ok=True)
    train, held_out = country_records()
    _write(out / "loreft_country_train.jsonl", train)
    _write(out / "loreft_country_eval.jsonl", held_out)
    _write(out / "bipo_sentiment_train.jsonl", sentiment_records(TOPICS_TRAIN, 0))
    _write(out / "bipo_sentiment_eval.jsonl", sentiment_records(TOPICS_EVAL, 1))
    print(json.dumps({"loreft_train": len(train), "loreft_eval": len(held_out)}))


if __name__ == "__main__":
    main()
