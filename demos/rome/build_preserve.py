"""Build ``demos/rome/preserve.json``: subjects whose keys MEMIT and AlphaEdit keep through an edit
(``gradpatch eval-edit --preserve``, :meth:`editors.MEMIT.preserve`).

The fact bank's neighbourhood prompts ask the edited relation of other cities of the edited city's country; the
statistics ``C`` come from generic text and cannot tell those cities' keys from the edited ones (docs/memit.md, "Why
the null space does not protect them"). This file lists other cities for the update to preserve: the ``P17``
candidates of :func:`demos.rome.build_facts.candidates` (cities outside the US of at least 100,000 inhabitants, not
capitals, whose name belongs to one place only) whose name appears nowhere in ``facts.json``, ``facts_dev.json`` or
``cases.json`` — so no preserved subject is edited or evaluated there — shuffled with a fixed seed, the first ``--n``.
Whether SmolLM2 knows their country does not matter: only their keys are used. No model is run.

Run: ``.venv/bin/python -m demos.rome.build_preserve [--n 1000] [--seed 0]`` (needs ``pip install -e ".[facts]"``).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable without an install
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from demos.rome.build_facts import RELATIONS, Candidate, candidates
from gradpatch.files.atomic import atomic_write_text

HERE = Path(__file__).resolve().parent
BANKS = ("facts.json", "facts_dev.json", "cases.json")


def preserved_cities(found: list[Candidate], banks_text: str, n: int, seed: int) -> list[dict[str, str]]:
    """``n`` records ``{"prompt", "subject", "relation_id", "target_true"}`` of the ``P17`` candidates in ``found``
    whose name does not occur in ``banks_text`` (the raw text of the fact banks), drawn with ``seed``.

    Raises:
        ValueError: fewer than ``n`` such cities.
    """
    pool = [c for c in found if c.relation_id == "P17" and c.subject not in banks_text]
    if len(pool) < n:
        raise ValueError(f"only {len(pool)} cities are named in no fact bank; ask for at most that many (--n)")
    random.Random(seed).shuffle(pool)
    prompt = RELATIONS["P17"].prompt
    return [{"prompt": prompt, "subject": c.subject, "relation_id": c.relation_id, "target_true": c.target_true}
            for c in pool[:n]]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=1000, help="cities to list (default %(default)s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(HERE / "preserve.json"))
    args = parser.parse_args(argv)
    text = "".join((HERE / name).read_text(encoding="utf-8") for name in BANKS)
    records = preserved_cities(candidates(), text, args.n, args.seed)
    atomic_write_text(Path(args.out), json.dumps(records, indent=1, ensure_ascii=False) + "\n")
    print(f"{len(records)} cities -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
