"""A cross-layer transcoder (CLT) against per-layer skip transcoders on SmolLM2-135M at one CPU budget: per layer FVU,
L0, dead fraction and CE loss recovered with that layer spliced alone, and CE loss recovered with all 30 spliced at
once, on the same held-out tokens; prints JSON.

Both sides are ``gradpatch fit`` as a user runs it (``python -m recipes.cli fit``, one subprocess each, one after
the other, never together), from their YAMLs (``recipes/configs/clt_smollm2.yaml`` and
``recipes/configs/transcoders_smollm2.yaml``) with the same overrides: the token budget ``--tokens`` (the same
corpus, chunks and order: both configs use seed 0 and the same data settings), the same number of latents per layer
(``--expansion-factor`` × 576), the same optimizer steps (``--batch-size`` chunks a step, ``--buffer-rows`` in
the shuffle buffer) and the same activation (``--activation topk --k K``: k latents per token and layer on
both sides; ``jumprelu``: the CLT's tanh penalty and the transcoders' own JumpReLU settings). The CLT's layer l
latents write to every MLP output l..29 (Ameisen et al. 2025); each transcoder writes its own MLP output, with a
linear skip term (Paulo et al. 2025) — the CLT has none, as circuit-tracer's CLT files hold none. The figures are
each run's ``metrics.json`` (recipes/dictionary/metrics.py: both sides scored by the same code on the same held-out
chunks). Each side reports its CPU seconds (``getrusage`` of the finished child) and wall seconds.

Run (CPU): ``OMP_NUM_THREADS=2 .venv/bin/python -m benchmarks.dictionaries.clt_vs_transcoders --tokens 8192``
(``--keep DIR`` keeps both runs' folders).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.harness import ROOT, emit, run_module

CONFIGS = {"clt": ROOT / "recipes" / "configs" / "clt_smollm2.yaml",
           "transcoders": ROOT / "recipes" / "configs" / "transcoders_smollm2.yaml"}


def overrides(side: str, args: argparse.Namespace, folder: Path) -> list[str]:
    """The command-line overrides of ``gradpatch fit`` for ``side`` (module docstring)."""
    part = "clt" if side == "clt" else "dictionary"
    common = ["--trainer.default_root_dir", str(folder), "--trainer.accelerator", "cpu",
              "--data.train_tokens", str(args.tokens), f"--model.{part}.expansion_factor", str(args.expansion_factor),
              f"--model.{part}.activation", args.activation, "--model.buffer_rows", str(args.buffer_rows),
              "--data.batch_size", str(args.batch_size)]
    return common + ([f"--model.{part}.k", str(args.k)] if args.activation == "topk" else [])


def train(side: str, args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    """One ``gradpatch fit`` run; its ``metrics.json`` summarised (per layer and over layers) with its cost."""
    before, start = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    run_module(sys.executable, "recipes.cli", ["fit", "--config", str(CONFIGS[side]), *overrides(side, args, folder)])
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    metrics = json.loads((folder / "metrics.json").read_text())
    layers = metrics["dictionaries"]
    per_layer = {node: {key: round(value[key], 4) for key in ("fvu", "l0", "dead_fraction", "ce_loss_recovered")}
                 for node, value in layers.items()}
    summary = {key: {"median": round(statistics.median(v[key] for v in per_layer.values()), 4),
                     "min": min(v[key] for v in per_layer.values()), "max": max(v[key] for v in per_layer.values())}
               for key in ("fvu", "l0", "dead_fraction", "ce_loss_recovered")}
    return {"command": ["gradpatch", "fit", "--config", str(CONFIGS[side].relative_to(ROOT)),
                        *overrides(side, args, Path("DIR"))],
            "cpu_seconds": round(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime, 1),
            "wall_seconds": round(time.perf_counter() - start, 1), "layers": len(per_layer), "summary": summary,
            "all_spliced": metrics.get("all_spliced"), "per_layer": per_layer}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192, help="training tokens of each side")
    parser.add_argument("--expansion-factor", type=int, default=2, help="latents per layer / 576")
    parser.add_argument("--activation", choices=["topk", "jumprelu"], default="topk")
    parser.add_argument("--k", type=int, default=32, help="topk: active latents per token and layer")
    parser.add_argument("--batch-size", type=int, default=2, help="chunks of 128 tokens per optimizer step")
    parser.add_argument("--buffer-rows", type=int, default=2048, help="rows of each side's shuffle buffer")
    parser.add_argument("--keep", help="a folder to keep both runs in (default: a temporary one)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(args.keep or scratch).resolve()
        report: dict[str, Any] = {"tokens": args.tokens, "latents_per_layer": 576 * args.expansion_factor,
                                  "activation": args.activation, "k": args.k if args.activation == "topk" else None}
        for side in ("transcoders", "clt"):
            report[side] = train(side, args, root / side)
    emit(report, indent=1)


if __name__ == "__main__":
    main()
