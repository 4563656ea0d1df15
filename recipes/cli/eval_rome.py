"""``gradpatch eval-rome``: edit every case of a CounterFact file with ROME and write the scores.

Usage::

    gradpatch eval-rome --cases demos/rome/cases.json --out metrics.json [--model PATH] [--node NODEPATH]

Without ``--model`` the embedded SmolLM2-135M-Instruct is edited at :data:`editors.rome.DEFAULT_SMOLLM2_NODE`; with
``--model``, ``--node`` names the linear layer to edit (e.g. ``transformer.h_5.mlp.c_proj`` for GPT-2).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from .options import DeprecatedAlias, add_edit_options, usage_error

__all__ = ["NAME", "register", "run_eval_rome"]

NAME = "eval-rome"


def run_eval_rome(args: argparse.Namespace) -> int:
    """Run ``eval-rome`` (see the module docstring); returns the exit status."""
    from editors import ROME, ROMEConfig, editable_graph, load_cases
    from gradpatch.files import atomic_write_text
    from gradpatch.models import default_device, load_model

    from ..errors import RecipeConfigError
    from ..rome_recipe import edit_node, evaluate_rome
    from ..rome_value import LightningValueRunner

    try:
        node = edit_node(args.model, args.node)
    except RecipeConfigError as error:
        return usage_error(NAME, error)
    cases = load_cases(args.cases)
    if args.n_cases is not None:
        cases = cases[: args.n_cases]
    t0 = time.perf_counter()
    model, tokenizer = load_model(args.model, device=args.device or default_device())
    pg = editable_graph(model, tokenizer)
    config = ROMEConfig(n_samples=args.n_samples, steps=args.steps, cache_dir=args.cache_dir,
                        progress=not args.quiet)
    rome = ROME(pg, tokenizer, node, config=config, corpus=args.corpus, value_runner=LightningValueRunner())
    t1 = time.perf_counter()
    result = evaluate_rome(rome, cases, progress=not args.quiet)
    result["model"] = args.model or "embedded:SmolLM2-135M-Instruct"
    result["seconds"]["load"] = t1 - t0
    out = atomic_write_text(Path(args.out), json.dumps(result, indent=1, ensure_ascii=False) + "\n")
    print(f"efficacy {result['efficacy_score']:.3f}  paraphrase {result['paraphrase_score']:.3f}  "
          f"neighborhood {result['neighborhood_score']:.3f}  ({result['n_cases']} cases) -> {out}")
    return 0


def register(subparsers: Any) -> None:
    """Add the ``eval-rome`` parser to the ``gradpatch`` sub-parsers."""
    p = subparsers.add_parser(
        NAME,
        help="edit each CounterFact case with ROME and write efficacy / paraphrase / neighborhood scores",
        description="For each case: compute the ROME edit on fresh weights, score it, restore the weights.",
    )
    p.add_argument("--cases", required=True, metavar="FILE.json", help="CounterFact-format JSON list")
    p.add_argument("--out", required=True, metavar="METRICS.json", help="where to write the scores")
    add_edit_options(p)
    p.add_argument("--n-cases", type=int, default=None, metavar="N", help="only the first N cases")
    p.add_argument("--limit", type=int, dest="n_cases", metavar="N", action=DeprecatedAlias, replacement="--n-cases",
                   help="deprecated name of --n-cases (as eval-edit names it)")
    p.add_argument("--quiet", action="store_true", help="no progress output")
    p.set_defaults(func=run_eval_rome)
