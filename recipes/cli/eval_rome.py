"""``gradpatch eval-rome``: an alias of ``gradpatch eval-edit --method rome`` that writes eval-rome's JSON.

Usage::

    gradpatch eval-rome --cases demos/rome/cases.json --out metrics.json [--model PATH] [--node NODEPATH]

Without ``--model`` the embedded SmolLM2-135M-Instruct is edited at :data:`editors.defaults.DEFAULT_SMOLLM2_NODE`;
with ``--model``, ``--node`` names the linear layer to edit (e.g. ``transformer.h_5.mlp.c_proj`` for GPT-2). Every
``eval-edit`` option but ``--method`` applies; with the defaults (``--batch-size 1 --sequential 1``) each case is
edited on fresh weights, scored and restored.

The run is ``eval-edit``'s (:func:`recipes.cli.eval_edit.evaluate_edits`), so the scores are scored as eval-edit
scores them: the unedited model's in batches of many cases, each edited case alone, and a neighbourhood prompt that
names the case's own subject left out (docs/architecture.md, "eval-rome"). The JSON has every ``eval-edit`` field,
with eval-rome's where the two differ: ``node`` (the edited NodePath), ``statistics`` as one record
(``n_tokens``, ``n_samples``, ``corpus``), ``seconds`` with ``cases`` (the evaluation) beside ``load`` and
``statistics_and_templates``, and each case row's ``seconds`` (its batch's edit).
"""

from __future__ import annotations

import argparse
from typing import Any

from .eval_edit import add_evaluation_options, evaluate_edits, write_metrics

__all__ = ["NAME", "eval_rome_record", "register", "run_eval_rome"]

NAME = "eval-rome"


def run_eval_rome(args: argparse.Namespace) -> int:
    """Run ``eval-rome`` (see the module docstring); returns the exit status."""
    result = evaluate_edits(args)
    return result if isinstance(result, int) else write_metrics(args, eval_rome_record(result))


def eval_rome_record(result: dict[str, Any]) -> dict[str, Any]:
    """``eval-edit``'s record of a ROME run (one node) with eval-rome's fields where the two differ (module
    docstring); the other fields are kept."""
    (statistics,) = result["statistics"]
    seconds_of = {record["batch"]: record["seconds"] for record in result["batches"]}
    return result | {
        "node": result["nodes"][0],
        "statistics": {key: statistics[key] for key in ("n_tokens", "n_samples", "corpus")},
        "seconds": result["seconds"] | {"cases": result["seconds"]["evaluation"]},
        "cases": [row | {"seconds": seconds_of[row["batch"]]} for row in result["cases"]],
    }


def register(subparsers: Any) -> None:
    """Add the ``eval-rome`` parser to the ``gradpatch`` sub-parsers."""
    p = subparsers.add_parser(
        NAME,
        help="edit each CounterFact case with ROME and write efficacy / paraphrase / neighborhood scores "
             "(eval-edit --method rome)",
        description="For each case: compute the ROME edit on fresh weights, score it, restore the weights. The same "
                    "run as `gradpatch eval-edit --method rome`, written in eval-rome's JSON.",
    )
    add_evaluation_options(p)
    p.set_defaults(func=run_eval_rome, method="rome")
