"""``gradpatch eval-rome``: edit every case of a CounterFact file with ROME and write the scores.

Registered into the ``gradpatch`` command by :mod:`recipes.cli` (it imports this module). Usage::

    gradpatch eval-rome --cases demos/rome/cases.json --out metrics.json [--model PATH] [--node NODEPATH]

Without ``--model`` the embedded SmolLM2-135M-Instruct is edited at :data:`editors.rome.DEFAULT_SMOLLM2_NODE`; with
``--model``, ``--node`` names the linear layer to edit (e.g. ``transformer.h_5.mlp.c_proj`` for GPT-2).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["register", "run_eval_rome"]


def _example_ids(tokenizer: Any) -> Any:
    from .tokens import pad_token_id, right_pad

    texts = ["The capital of France is", "The Eiffel Tower is located in the city of"]
    ids, _ = right_pad([list(tokenizer(t)["input_ids"]) for t in texts], pad_token_id(tokenizer))
    return ids


def run_eval_rome(args: argparse.Namespace) -> int:
    """Run ``eval-rome`` (see the module docstring); returns the exit status."""
    import torch

    from gradpatch import PatchableGraph
    from gradpatch.models import load_model

    from .counterfact import load_cases
    from .evaluate import evaluate_cases
    from .rome import DEFAULT_SMOLLM2_NODE, ROME, ROMEConfig

    node = args.node
    if node is None:
        if args.model is not None:
            print("gradpatch eval-rome: --model needs --node, the NodePath of the linear layer to edit, e.g. "
                  "model.layers_4.mlp.down_proj (Llama) or transformer.h_5.mlp.c_proj (GPT-2); "
                  "`gradpatch graph --model PATH` prints the node tree", file=sys.stderr)
            return 2
        node = DEFAULT_SMOLLM2_NODE
    cases = load_cases(args.cases)
    if args.limit is not None:
        cases = cases[: args.limit]
    t0 = time.perf_counter()
    model, tokenizer = load_model(args.model)
    with torch.no_grad():
        pg = PatchableGraph(model, _example_ids(tokenizer).to(next(model.parameters()).device), use_cache=False)
    pg.eval()
    config = ROMEConfig(n_samples=args.n_samples, steps=args.steps, cache_dir=args.cache_dir,
                        progress=not args.quiet)
    rome = ROME(pg, tokenizer, node, config=config, corpus=args.corpus)
    t1 = time.perf_counter()
    stats = rome.statistics()
    rome.templates()
    t2 = time.perf_counter()
    metrics = evaluate_cases(pg, tokenizer, cases, rome.compute, progress=not args.quiet)
    t3 = time.perf_counter()
    result = {
        "efficacy_score": metrics["efficacy_score"],
        "paraphrase_score": metrics["paraphrase_score"],
        "neighborhood_score": metrics["neighborhood_score"],
        "n_cases": metrics["n_cases"],
        "pre": metrics["pre"],
        "node": node,
        "model": args.model or "embedded:SmolLM2-135M-Instruct",
        "config": config.to_json(),
        "statistics": {"n_tokens": stats.n_tokens, "n_samples": stats.n_samples, "corpus": stats.corpus},
        "seconds": {"load": t1 - t0, "statistics_and_templates": t2 - t1, "cases": t3 - t2},
        "cases": metrics["cases"],
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"efficacy {result['efficacy_score']:.3f}  paraphrase {result['paraphrase_score']:.3f}  "
          f"neighborhood {result['neighborhood_score']:.3f}  ({result['n_cases']} cases) -> {out}")
    return 0


def register(subparsers: Any) -> None:
    """Add the ``eval-rome`` parser to the ``gradpatch`` sub-parsers."""
    from .rome import DEFAULT_SMOLLM2_NODE
    from .stats import DEFAULT_N_SAMPLES

    p = subparsers.add_parser(
        "eval-rome",
        help="edit each CounterFact case with ROME and write efficacy / paraphrase / neighborhood scores",
        description="For each case: compute the ROME edit on fresh weights, score it, restore the weights.",
    )
    p.add_argument("--cases", required=True, metavar="FILE.json", help="CounterFact-format JSON list")
    p.add_argument("--out", required=True, metavar="METRICS.json", help="where to write the scores")
    p.add_argument("--model", default=None, metavar="PATH",
                   help="save_pretrained directory or .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--node", default=None, metavar="NODEPATH",
                   help=f"linear layer to edit (default for the embedded model: {DEFAULT_SMOLLM2_NODE})")
    p.add_argument("--corpus", default=None, metavar="FILE",
                   help="text corpus for the second moment (default: the offline English Wikipedia summaries)")
    p.add_argument("--n-samples", type=int, default=DEFAULT_N_SAMPLES, help="corpus documents (default %(default)s)")
    p.add_argument("--steps", type=int, default=25, help="maximum value-optimisation steps (default %(default)s)")
    p.add_argument("--cache-dir", default=None, help="statistics cache (default ~/.cache/gradpatch/stats)")
    p.add_argument("--limit", type=int, default=None, metavar="N", help="only the first N cases")
    p.add_argument("--quiet", action="store_true", help="no progress output")
    p.set_defaults(func=run_eval_rome)


try:  # registration needs recipes.cli (part of the same distribution)
    from recipes.cli import register_subcommand
except ImportError:  # pragma: no cover - editors used without recipes
    pass
else:
    register_subcommand("eval-rome", register)
