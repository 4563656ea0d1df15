"""Check that a model knows every fact of a CounterFact-format case file before we edit it.

For each case it checks, on the unedited model:

- ``greedy``: the greedy continuation of the rewrite prompt (``prompt.format(subject)``) starts with
  ``target_true`` — the model demonstrably knows the fact;
- ``paraphrases``: every paraphrase prompt scores ``target_true`` above ``target_new`` (mean token log-prob);
- ``neighbors``: every neighbourhood prompt scores ``target_true`` above ``target_new`` (otherwise the
  neighbourhood score could not measure damage done by the edit);
- structure: at least 2 paraphrase and 2 neighbourhood prompts, the subject in every paraphrase, not in any
  neighbourhood prompt.

Prints one row per case and a summary; exits 1 when any case fails (``--json`` writes the rows).

Run: ``.venv/bin/python -m demos.rome.verify_cases [--cases demos/rome/cases.json] [--model PATH] [--json OUT]``
(1–3 minutes on 2 CPU cores for the committed 44 cases: loading the model, 44 short generations, scoring).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):  # run as a script: make the repository root importable without an install
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from editors.evaluation.counterfact import CounterFactCase, load_cases
from editors.passes.scoring import mean_target_logprobs
from recipes.generation import greedy_generate

DEFAULT_CASES = Path(__file__).resolve().parent / "cases.json"


def verify_case(model: Any, tokenizer: Any, case: CounterFactCase) -> dict[str, Any]:
    """Run every check on one case.

    Returns:
        A row: ``case_id``, ``subject``, ``continuation``, booleans ``greedy``, ``paraphrases``,
        ``neighbors``, ``structure``, ``ok``, and ``problems`` (strings).
    """
    req = case.request
    forward = lambda ids: model(ids, use_cache=False)  # noqa: E731
    n_true = len(tokenizer(" " + req.target_true, add_special_tokens=False).input_ids)
    continuation = greedy_generate(model, tokenizer, [req.text], n_true + 2, skip_special_tokens=False)[0]
    problems: list[str] = []
    greedy = continuation.strip().startswith(req.target_true)
    if not greedy:
        problems.append(f"greedy continuation {continuation!r} does not start with {req.target_true!r}")
    prompts = list(case.paraphrase_prompts) + list(case.neighborhood_prompts)
    true_lp = mean_target_logprobs(forward, tokenizer, prompts, [req.target_true] * len(prompts))
    new_lp = mean_target_logprobs(forward, tokenizer, prompts, [req.target_new] * len(prompts))
    prefers_true = (true_lp > new_lp).tolist()
    n_para = len(case.paraphrase_prompts)
    paraphrases, neighbors = all(prefers_true[:n_para]), all(prefers_true[n_para:])
    for prompt, ok in zip(prompts, prefers_true):
        if not ok:
            problems.append(f"{prompt!r} prefers {req.target_new!r} over {req.target_true!r}")
    structure = True
    if n_para < 2 or len(case.neighborhood_prompts) < 2:
        structure = False
        problems.append("needs at least 2 paraphrase and 2 neighbourhood prompts")
    if any(req.subject not in p for p in case.paraphrase_prompts):
        structure = False
        problems.append("a paraphrase prompt lacks the subject")
    if any(req.subject in p for p in case.neighborhood_prompts):
        structure = False
        problems.append("a neighbourhood prompt mentions the subject")
    return {
        "case_id": case.case_id,
        "subject": req.subject,
        "relation_id": req.relation_id,
        "prompt": req.text,
        "target_true": req.target_true,
        "continuation": continuation,
        "greedy": greedy,
        "paraphrases": paraphrases,
        "neighbors": neighbors,
        "structure": structure,
        "ok": greedy and paraphrases and neighbors and structure,
        "problems": problems,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=str(DEFAULT_CASES), help="CounterFact JSON file (default: %(default)s)")
    parser.add_argument("--model", default=None, help="model directory or .gguf (default: embedded SmolLM2-135M)")
    parser.add_argument("--json", default=None, metavar="OUT", help="also write the per-case rows to this JSON file")
    args = parser.parse_args(argv)

    from gradpatch.files.loaders import load_model

    torch.set_grad_enabled(False)
    model, tokenizer = load_model(args.model)
    cases = load_cases(args.cases)
    rows = [verify_case(model, tokenizer, case) for case in cases]
    for row in rows:
        mark = "ok  " if row["ok"] else "FAIL"
        print(f"{mark} {row['case_id']:>3} {row['relation_id']:<6} {row['prompt']!r} -> {row['continuation']!r}")
        for problem in row["problems"]:
            print(f"       {problem}")
    relations = sorted({row["relation_id"] for row in rows})
    n_ok = sum(row["ok"] for row in rows)
    print(f"{n_ok}/{len(rows)} cases verified; {len(relations)} relation types: {', '.join(relations)}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    return 0 if n_ok == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
