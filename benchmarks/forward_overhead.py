"""Forward-pass overhead of PatchableGraph against the original model; prints JSON.

For a tiny random Llama and for the embedded SmolLM2-135M-Instruct (skip with ``--skip-real``) it measures, under
``torch.no_grad()`` with 2 threads, the median wall time of:

- ``plain``: the original ``model(input_ids, use_cache=False)``;
- ``no_patch``: ``pg(input_ids, use_cache=False)`` outside any patch;
- ``probe``: the same inside ``pg.patch({node: ProbePatch()})``;
- ``add``: the same inside ``pg.patch({node: AddPatch(value=zeros)})``;

with ``node = model.layers_<mid>.mlp.down_proj.output``. The four are measured round-robin (one call of each per
round) after a warm-up, so drift affects them alike; ratios are medians over the plain median, all from this run.
Patch contexts are entered before the timer starts: the times are of the forward pass alone.

Run: ``.venv/bin/python benchmarks/forward_overhead.py [--skip-real] [--runs N]``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

if __package__ in (None, ""):  # run as a script: make the repository root importable without an install
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent.parent))

from editors.testing import tiny_llama
from gradpatch import AddPatch, PatchableGraph, ProbePatch

PROMPT = "The Eiffel Tower is located in the city of"


def _count_nodes(pg: PatchableGraph) -> dict[str, int]:
    """Node counts: NodePaths of the tree, fx graph nodes over all extracted graphs, lines of the drawn tree."""
    return {
        "node_paths": len(pg._tree.all_paths()),
        "fx_nodes": sum(len(m.graph.nodes) for m in pg.modules() if isinstance(m, torch.fx.GraphModule)),
        "tree_lines": len(repr(pg.graph).splitlines()),
    }


def _time_call(fn: Callable[[], Any], context: Callable[[], contextlib.AbstractContextManager[Any]]) -> float:
    """Seconds taken by ``fn()``, timed inside (not including) ``context()``."""
    with context():
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0


def bench_model(
    model: nn.Module, input_ids: torch.Tensor, *, runs: int, warmup: int, construct_runs: int
) -> dict[str, Any]:
    """Measure one model; see the module docstring.

    Args:
        model: a transformers causal LM in eval mode (``model.model.layers`` exists).
        input_ids: example token ids, shape (1, seq).
        runs: timed rounds (one call of each variant per round).
        warmup: untimed rounds first.
        construct_runs: PatchableGraph constructions to time (median reported).

    Returns:
        Medians in milliseconds, ratios to the plain forward, construction seconds and node counts.
    """
    construct_times = []
    pg = None
    for _ in range(construct_runs):
        pg = None
        t0 = time.perf_counter()
        pg = PatchableGraph(model, input_ids, use_cache=False)
        construct_times.append(time.perf_counter() - t0)
    assert pg is not None

    mid = len(model.model.layers) // 2
    node = f"model.layers_{mid}.mlp.down_proj.output"
    with torch.no_grad():
        probe = ProbePatch()
        with pg.patch({node: probe}):
            pg(input_ids, use_cache=False)
        zeros = torch.zeros_like(probe.activation)

    variants: dict[str, tuple[Callable[[], Any], Callable[[], contextlib.AbstractContextManager[Any]]]] = {
        "plain": (lambda: model(input_ids, use_cache=False), contextlib.nullcontext),
        "no_patch": (lambda: pg(input_ids, use_cache=False), contextlib.nullcontext),
        "probe": (lambda: pg(input_ids, use_cache=False), lambda: pg.patch({node: ProbePatch()})),
        "add": (lambda: pg(input_ids, use_cache=False), lambda: pg.patch({node: AddPatch(value=zeros)})),
    }
    times: dict[str, list[float]] = {k: [] for k in variants}
    with torch.no_grad():
        for i in range(warmup + runs):
            for name, (fn, ctx) in variants.items():
                elapsed = _time_call(fn, ctx)
                if i >= warmup:
                    times[name].append(elapsed)

    med = {k: statistics.median(v) for k, v in times.items()}
    result: dict[str, Any] = {
        "seq_len": int(input_ids.shape[-1]),
        "patched_node": node,
        "runs": runs,
        "plain_ms": med["plain"] * 1e3,
        "no_patch_ms": med["no_patch"] * 1e3,
        "probe_ms": med["probe"] * 1e3,
        "add_ms": med["add"] * 1e3,
        "no_patch_ratio": med["no_patch"] / med["plain"],
        "probe_ratio": med["probe"] / med["plain"],
        "add_ratio": med["add"] / med["plain"],
        "construction_s": statistics.median(construct_times),
        "construction_runs": construct_runs,
    }
    result.update(_count_nodes(pg))
    return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in result.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-real", action="store_true", help="skip SmolLM2-135M (saves ~30 s of loading)")
    parser.add_argument("--runs", type=int, default=None, help="timed rounds (default: 100 tiny, 20 real)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed rounds first (default: 5)")
    parser.add_argument("--real-construct-runs", type=int, default=1, help="constructions to time on SmolLM2 (1-3)")
    args = parser.parse_args(argv)

    torch.set_num_threads(2)
    report: dict[str, Any] = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "threads": torch.get_num_threads(),
    }

    tiny = tiny_llama(1000, hidden=64, intermediate=128, init_std=0.02)  # 2 layers, 4 heads, 2 KV heads
    ids = torch.randint(0, 1000, (1, 16), generator=torch.Generator().manual_seed(0))
    report["tiny_llama"] = bench_model(tiny, ids, runs=args.runs or 100, warmup=args.warmup, construct_runs=3)

    if not args.skip_real:
        from gradpatch.models import load_embedded_model

        model, tokenizer = load_embedded_model()
        real_ids = tokenizer(PROMPT, return_tensors="pt").input_ids
        report["smollm2_135m"] = bench_model(
            model, real_ids, runs=args.runs or 20, warmup=args.warmup, construct_runs=args.real_construct_runs
        )

    json.dump(report, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
