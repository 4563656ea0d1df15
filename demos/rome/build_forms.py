"""Build the prompt-form suite (issue 50) of a split: the first ``--n-cases`` cases of a fact-bank file, each with the
rewrite in the prompt forms its unedited model answers with the true target (:mod:`editors.evaluation.forms`:
``subject_first``, ``unrelated_sentence``, ``question``, ``lower_case``, ``clause``).

The output is a CounterFact file (the cases as they were, plus ``form_prompts``) that ``gradpatch eval-edit --cases``
reads; its JSON reports each form's score under ``forms``. Forms are kept as the unedited embedded SmolLM2-135M reads
them after ``--start-token`` (default ``auto``: ``<|endoftext|>``, as ROME reads texts). The committed suites:

    .venv/bin/python -m demos.rome.build_forms --cases demos/rome/facts_test.json --n-cases 100 \\
        --out demos/rome/facts_test_forms.json
    .venv/bin/python -m demos.rome.build_forms --cases demos/rome/facts_dev2.json --n-cases 100 \\
        --out demos/rome/facts_dev2_forms.json

It prints, per form, how many candidates the model answered and how many were written.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable without an install
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from editors import editable_graph
from editors.evaluation.counterfact import CounterFactCase, load_cases
from editors.evaluation.forms import FORMS, candidate_forms, known_forms
from editors.passes.start_token import with_start_token
from gradpatch.files.atomic import atomic_write_text

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """Build the suite (see the module docstring); returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", required=True, help="a fact-bank split, e.g. demos/rome/facts_test.json")
    parser.add_argument("--n-cases", type=int, default=100, help="the first N cases (default %(default)s)")
    parser.add_argument("--out", required=True, help="where to write the suite (JSON)")
    parser.add_argument("--start-token", default="auto", help="the token texts are read after (default %(default)s; "
                                                              "'none' for none)")
    args = parser.parse_args(argv)
    from gradpatch.files.loaders import load_embedded_model

    cases = load_cases(args.cases)[: args.n_cases]
    model, tokenizer = load_embedded_model()
    pg = editable_graph(model, tokenizer)
    reader = with_start_token(tokenizer, None if args.start_token == "none" else args.start_token)
    candidates = [candidate_forms(case, i) for i, case in enumerate(cases)]
    kept = known_forms(pg, reader, cases, candidates)
    suite = [CounterFactCase(case_id=c.case_id, request=c.request, paraphrase_prompts=c.paraphrase_prompts,
                             neighborhood_prompts=c.neighborhood_prompts, form_prompts=forms).to_dict()
             for c, forms in zip(cases, kept)]
    atomic_write_text(Path(args.out), json.dumps(suite, indent=1, ensure_ascii=False) + "\n")
    offered = Counter(name for forms in candidates for name in forms)
    written = Counter(name for forms in kept for name in forms)
    print(json.dumps({"cases": len(cases), "start_token": args.start_token,
                      "forms": {name: {"candidates": offered[name], "kept": written[name]} for name in FORMS}}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
