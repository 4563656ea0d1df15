"""Split the evaluation bank ``facts.json`` once, by subject, into a development half and a test half.

``facts.json`` (built by :mod:`demos.rome.build_facts`; every subject appears once) has served as the evaluation set of
earlier sessions; settings were chosen on ``facts_dev.json``. From here on, settings are chosen on the development
facts only (``facts_dev.json`` and ``facts_dev2.json``, this script's development half), and the scores docs/rome.md and
docs/memit.md report as test scores come from ``facts_test.json``, which no setting was chosen on.

The split is by subject and stratified by relation (each relation's cases shuffled with a fixed seed, then dealt out
in turn), so both halves hold every relation in the same proportion. A subject is never in both halves; a test case's
subject may still appear in a development case's neighbourhood prompt (the bank's neighbourhood subjects are other
subjects with the same object), which this split does not forbid: it only keeps the edited facts apart. Run once;
the committed files are the split.

Run: ``.venv/bin/python -m demos.rome.split_facts [--seed 0]``.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository root importable without an install
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from gradpatch.files.atomic import atomic_write_text

HERE = Path(__file__).resolve().parent

__all__ = ["split_by_subject", "main"]


def split_by_subject(cases: list[dict[str, Any]], seed: int = 0) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``(development, test)``: the cases dealt out alternately per relation after a seeded shuffle; each keeps its
    order of ``cases`` within its half.

    Raises:
        ValueError: a subject appears in two cases (the split would not keep it to one half).
    """
    by_relation: dict[str, list[int]] = defaultdict(list)
    seen: dict[str, int] = {}
    for i, case in enumerate(cases):
        subject = case["requested_rewrite"]["subject"]
        if subject in seen:
            raise ValueError(f"Cases {seen[subject]} and {i} share the subject {subject!r}; give each subject once")
        seen[subject] = i
        by_relation[case["requested_rewrite"]["relation_id"]].append(i)
    rng = random.Random(seed)
    test: set[int] = set()
    for relation in sorted(by_relation):
        indices = by_relation[relation]
        rng.shuffle(indices)
        test.update(indices[1::2])
    return [c for i, c in enumerate(cases) if i not in test], [c for i, c in enumerate(cases) if i in test]


def main(argv: list[str] | None = None) -> int:
    """Write ``facts_dev2.json`` and ``facts_test.json`` beside ``facts.json``; returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bank", default=str(HERE / "facts.json"), help="the bank to split (default %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="shuffle seed (default %(default)s)")
    args = parser.parse_args(argv)
    bank = Path(args.bank)
    cases = json.loads(bank.read_text(encoding="utf-8"))
    development, test = split_by_subject(cases, seed=args.seed)
    for name, part in (("facts_dev2.json", development), ("facts_test.json", test)):
        atomic_write_text(bank.parent / name, json.dumps(part, indent=1, ensure_ascii=False) + "\n")
        print(f"{name}: {len(part)} cases")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
