"""The ROME demo (``make demo``): trace a fact, edit it, evaluate, save, all on the embedded SmolLM2-135M-Instruct.

Steps (each timed; the timings go to ``<out>/summary.json``):

1. load the model and build its PatchableGraph;
2. causal tracing (Meng et al. 2022, section 2) of "The Eiffel Tower is located in the city of" → " Paris":
   heatmaps per kind (hidden state, MLP output, attention output) as PNG + JSON, and as TensorBoard images; the
   MLP row of the edited layer shows why that layer is edited;
3. the ROME recipe (key → second-moment statistics → value via ``Trainer.fit`` → rank-one update) writes
   Eiffel Tower → Rome at the default node; greedy generations before and after for the rewrite prompt, two
   paraphrases and two neighbours;
4. ``eval-rome`` on the demo cases (``demos/rome/cases.json``, an evenly spread subset by default), each edited on
   fresh weights: efficacy, paraphrase and neighborhood scores;
5. the Eiffel edit saved as safetensors + JSON; the TensorBoard command printed.

Run::

    .venv/bin/python -m demos.rome.demo                       # embedded model, CPU (GPU when present)
    .venv/bin/python -m demos.rome.demo --model path/to/gpt2-xl --node transformer.h_17.mlp.c_proj --device cuda

The first run computes the second-moment statistics of the edited layer (cached under ``~/.cache/gradpatch``);
see demos/rome/README.md for the output and timings.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from editors import ROME, CounterFactCase, ROMEConfig, editable_graph, load_cases
from editors.causal_trace import KINDS, TraceResult, causal_trace, save_trace
from editors.defaults import DEFAULT_N_SAMPLES
from gradpatch.files.loaders import EMBEDDED_MODEL_NAME, default_device, load_model
from gradpatch.progress import ProgressBar
from recipes.errors import RecipeConfigError
from recipes.editing.rome_recipe import ROMERun, edit_node, evaluate_rome, run_rome
from recipes.editing.rome_value import LightningValueRunner
from recipes.reports.trace_tensorboard import log_trace_to_tensorboard

CASES_FILE = Path(__file__).with_name("cases.json")
#: The demo's fact: the case of cases.json whose subject this is (its paraphrases and neighbours are printed).
DEMO_SUBJECT = "Eiffel Tower"
#: The traced prompt (the subject with its article, as in the paper's Figure 1).
TRACE_PROMPT, TRACE_SUBJECT = "{} is located in the city of", "The Eiffel Tower"


def spread(cases: Sequence[CounterFactCase], n: int) -> list[CounterFactCase]:
    """``n`` cases evenly spaced over the file (so the subset spans its relation types); all when ``n <= 0``."""
    if n <= 0 or n >= len(cases):
        return list(cases)
    return [cases[round(i * (len(cases) - 1) / max(n - 1, 1))] for i in range(n)]


def _demo_case(cases: Sequence[CounterFactCase]) -> CounterFactCase:
    for case in cases:
        if case.request.subject == DEMO_SUBJECT:
            return case
    raise SystemExit(f"demo: no case with subject {DEMO_SUBJECT!r} in the cases file")


def _layer_of(node: str) -> int | None:
    """The block index in a NodePath such as ``model.layers_3.mlp.down_proj`` (``None`` if there is none)."""
    for part in node.split("."):
        head, _, index = part.rpartition("_")
        if head and index.isdigit():
            return int(index)
    return None


def _print_trace(result: TraceResult, node: str) -> None:
    s0, s1 = result.subject_range
    print(f"  P({result.answer!r}): clean {result.clean_prob:.3f}, subject corrupted {result.corrupted_prob:.3f} "
          f"({result.samples} noise samples)")
    for kind, trace in result.kinds.items():
        layer, token, prob = trace.peak()
        print(f"  {kind:>6}: highest restoration p = {prob:.3f} at layer {layer}, token {result.tokens[token]!r}")
    edited = _layer_of(node)
    mlp = result.kinds.get("mlp")
    if mlp is None or edited is None or edited >= mlp.scores.shape[0]:
        return
    subject_best = mlp.scores[:, s0:s1].max(dim=1).values  # [num_layers]: best subject token per layer
    row = "  ".join(f"{layer}:{float(p):.2f}" for layer, p in enumerate(subject_best.tolist()))
    print(f"  MLP restorations (window {mlp.window}) at the subject tokens, best per layer:\n    {row}")
    rank = int((subject_best > subject_best[edited]).sum()) + 1
    print(f"  the edited layer {edited} ranks {rank} of {len(subject_best)}: its MLP window restores "
          f"p = {float(subject_best[edited]):.3f} from {result.corrupted_prob:.3f}; the fact is stored in the early "
          f"MLPs at the subject, which is where ROME writes")


def _print_generations(run: ROMERun, case: CounterFactCase) -> None:
    roles = {case.request.text: "rewrite"}
    roles.update({p: "paraphrase" for p in case.paraphrase_prompts})
    roles.update({p: "neighbour" for p in case.neighborhood_prompts})
    for prompt, before, after in zip(run.prompts, run.before, run.after):
        print(f"  [{roles.get(prompt, 'prompt')}] {prompt}")
        print(f"      before: {before!r}")
        print(f"      after:  {after!r}")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the demo; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m demos.rome.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, metavar="PATH",
                        help="save_pretrained directory or .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--node", default=None, metavar="NODEPATH",
                        help="linear layer to edit (default for the embedded model: model.layers_3.mlp.down_proj)")
    parser.add_argument("--device", default=None, help="torch device (default: cuda when available, else cpu)")
    parser.add_argument("--out", default="runs/rome_demo", help="output folder (default: %(default)s)")
    parser.add_argument("--cases", default=str(CASES_FILE), help="CounterFact-format cases (default: the demo's)")
    parser.add_argument("--n-cases", type=int, default=8, metavar="N",
                        help="evaluate N cases spread over the file; 0 for all (default: %(default)s)")
    parser.add_argument("--trace-samples", type=int, default=5, metavar="N",
                        help="noise samples of the causal trace (the paper uses 10; default: %(default)s)")
    parser.add_argument("--n-samples", type=int, default=DEFAULT_N_SAMPLES,
                        help="corpus documents for the second moment (default %(default)s)")
    parser.add_argument("--cache-dir", default=None, help="statistics cache (default ~/.cache/gradpatch/stats)")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)

    try:
        node = edit_node(args.model, args.node)
    except RecipeConfigError as error:
        print(f"demo: {error}", file=sys.stderr)
        return 2
    out = Path(args.out)
    logdir = out / "tensorboard"
    all_cases = load_cases(args.cases)
    case = _demo_case(all_cases)
    eval_cases = spread(all_cases, args.n_cases)
    seconds: dict[str, float] = {}
    device = args.device or default_device()
    model_name = Path(args.model).name if args.model else EMBEDDED_MODEL_NAME

    print(f"[1/5] loading {model_name} on {device} and building its PatchableGraph")
    t = time.perf_counter()
    model, tokenizer = load_model(args.model, device=device)
    pg = editable_graph(model, tokenizer)
    seconds["load"] = time.perf_counter() - t

    print(f"[2/5] causal trace of {TRACE_PROMPT.format(TRACE_SUBJECT)!r}")
    t = time.perf_counter()
    with ProgressBar("trace", unit="row", enabled=not args.quiet) as bar:
        trace = causal_trace(pg, tokenizer, TRACE_PROMPT, TRACE_SUBJECT, kinds=KINDS, samples=args.trace_samples,
                             progress=bar)
    written = save_trace(trace, out / "trace", model_name=model_name)
    log_trace_to_tensorboard(trace, logdir / "trace", model_name=model_name)
    seconds["trace"] = time.perf_counter() - t
    _print_trace(trace, node)
    print("  heatmaps: " + ", ".join(str(written[k]) for k in trace.kinds))

    print(f"[3/5] ROME: {case.request.text!r} -> {case.request.target_new!r} at {node}")
    config = ROMEConfig(n_samples=args.n_samples, cache_dir=args.cache_dir, progress=not args.quiet)
    rome = ROME(pg, tokenizer, node, config=config, value_runner=LightningValueRunner(logdir=logdir, name="rome"))
    t = time.perf_counter()
    rome.statistics()
    seconds["statistics"] = time.perf_counter() - t
    run = run_rome(rome, case.request, prompts=list(case.paraphrase_prompts) + list(case.neighborhood_prompts))
    seconds["edit"], seconds["generate"] = run.seconds["edit"], run.seconds["generate"]
    info = run.edit.info
    print(f"  {info['steps']} optimiser steps, loss {info['loss']:.4f}; P({case.request.target_new!r}) "
          f"{run.probabilities['before']['new']:.4f} -> {run.probabilities['after']['new']:.4f}, "
          f"P({case.request.target_true!r}) {run.probabilities['before']['true']:.4f} -> "
          f"{run.probabilities['after']['true']:.4f}")
    _print_generations(run, case)
    succeeded = run.after[0].strip().startswith(case.request.target_new)
    run.edit.restore(pg)  # the evaluation edits each case on the original weights

    print(f"[4/5] eval-rome on {len(eval_cases)} of {len(all_cases)} cases ({args.cases})")
    t = time.perf_counter()
    evaluator = ROME(pg, tokenizer, node, config=config, statistics=rome.statistics(),
                     value_runner=LightningValueRunner())
    metrics = evaluate_rome(evaluator, eval_cases, progress=not args.quiet)
    seconds["eval"] = time.perf_counter() - t
    (out / "metrics.json").write_text(json.dumps(metrics, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"  efficacy {metrics['efficacy_score']:.3f}  paraphrase {metrics['paraphrase_score']:.3f}  "
          f"neighborhood {metrics['neighborhood_score']:.3f}  (before any edit: efficacy "
          f"{metrics['pre']['efficacy_score']:.3f}, paraphrase {metrics['pre']['paraphrase_score']:.3f}, "
          f"neighborhood {metrics['pre']['neighborhood_score']:.3f}) -> {out / 'metrics.json'}")

    print("[5/5] saving")
    edit_dir = run.edit.save(out / "edit")
    summary: dict[str, Any] = {
        "model": model_name, "node": node, "device": str(device),
        "edit": {"request": case.request.to_dict(), "succeeded": succeeded, "steps": info["steps"],
                 "loss": info["loss"], "probabilities": run.probabilities, "dir": str(edit_dir)},
        "generations": [{"prompt": p, "before": b, "after": a} for p, b, a in zip(run.prompts, run.before, run.after)],
        "trace": {"json": str(written["json"]), "png": {k: str(written[k]) for k in trace.kinds},
                  "clean_prob": trace.clean_prob, "corrupted_prob": trace.corrupted_prob},
        "scores": {k: metrics[k] for k in ("efficacy_score", "paraphrase_score", "neighborhood_score", "n_cases")},
        "tensorboard": {"logdir": str(logdir), "rome_run": run.log_dir},
        "seconds": {k: round(v, 1) for k, v in seconds.items()},
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"  edit: {edit_dir} (edit.safetensors + edit.json); summary: {out / 'summary.json'}")
    steps = ", ".join(f"{name} {value:.1f}" for name, value in seconds.items())
    print(f"  seconds: {steps}; total {sum(seconds.values()):.1f}")
    print(f"\nOpen the TensorBoard run with:\n  tensorboard --logdir {logdir}")
    return 0 if succeeded else 1


if __name__ == "__main__":
    sys.exit(main())
