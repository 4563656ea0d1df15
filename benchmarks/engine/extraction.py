"""What building a PatchableGraph costs (issue 62, item 6): extraction against the tracers underneath; prints JSON.

For SmolLM2-135M-Instruct (the embedded GGUF, float32 on CPU; its config with random weights with
``--random-weights``) and a tiny random Llama, on one prompt with ``use_cache=False``, it measures process CPU seconds
(``time.process_time``) and wall seconds of:

- ``gradpatch.first_in_fresh_process``: ``PatchableGraph(model, ids, use_cache=False)`` as the first extraction of
  a new process (a subprocess that loads the model, then extracts once; ``--fresh`` of them, min reported), with
  the seconds the garbage collector ran during it (``gc_s``) and its full collections per process; and
  ``first_in_fresh_process_gc_frozen``, the same after ``gc.freeze()`` (the collector's first full pass over
  torch's, transformers' and the model's objects, which the first extraction's allocations trigger, is what a
  fresh process adds: a user who calls ``gc.freeze()`` after loading avoids it, process-wide);
- ``gradpatch.repeated``: the same extraction repeated ``--repeats`` times in this process after one untimed one;
- ``gradpatch.repeated_without_reuse``: the same with every module traced (``graph_reuse_disabled()``, no graph
  reused across repeated modules: :mod:`gradpatch.extraction.reuse`);
- the references, in this process on the same model and inputs: ``forward`` (one plain ``model(ids)``, the floor:
  extraction runs the model once), ``fx_tracer`` (one ``torch.fx.Tracer().trace`` of the graph under a decoder
  layer's MLP, a module plain fx traces whole, times the number of MLPs: fx's own per-module cost at this depth)
  and ``torch_export`` (``torch.export.export(model, (ids,), {"use_cache": False}, strict=False)``, the whole
  model as one graph; ``--export-runs`` times, 0 skips it).

Each entry gives ``cpu_s_min`` / ``cpu_s_median`` / ``wall_s_min`` / ``wall_s_median`` over its runs (the machine
may be shared: CPU seconds and the min are the figures to compare) and the ratios are gradpatch's repeated min over
each reference's min, all from this run. Torch runs on ``--threads`` threads (default 1; ``OMP_NUM_THREADS`` is set
to it before torch loads, in the subprocesses too).

Run: ``OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.engine.extraction [--repeats 5] [--fresh 2]
[--export-runs 1] [--skip-tiny] [--skip-real] [--random-weights]``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from benchmarks.harness import emit, run_module

_PROMPT = "The capital of France is Paris, and the capital of Italy is"


def _timings(fn: Callable[[], Any], runs: int) -> dict[str, float]:
    """CPU and wall seconds of ``runs`` calls of ``fn`` (min and median of each)."""
    cpu, wall = [], []
    for _ in range(runs):
        start_cpu, start_wall = time.process_time(), time.perf_counter()
        fn()
        cpu.append(time.process_time() - start_cpu)
        wall.append(time.perf_counter() - start_wall)
    return {"runs": runs, "cpu_s_min": round(min(cpu), 4), "cpu_s_median": round(statistics.median(cpu), 4),
            "wall_s_min": round(min(wall), 4), "wall_s_median": round(statistics.median(wall), 4)}


def _model_and_inputs(name: str, random_weights: bool) -> tuple[Any, Any, str]:
    """``(model, input_ids [1, seq], description of the weights)`` for ``smollm2`` or ``tiny_llama``."""
    import torch

    if name == "tiny_llama":
        from gradpatch.testing import tiny_llama

        model = tiny_llama(1000, hidden=64, intermediate=128, init_std=0.02)
        return model, torch.randint(0, 1000, (1, 12), generator=torch.Generator().manual_seed(0)), "random"
    from gradpatch.files.loaders import load_model, random_embedded_model

    if random_weights:
        model = random_embedded_model(torch.float32, "cpu")
        ids = torch.randint(0, model.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
        return model, ids, "random weights, embedded config"
    model, tokenizer = load_model(None)
    return model, tokenizer(_PROMPT, return_tensors="pt").input_ids, "embedded GGUF"


def _extract(model: Any, ids: Any) -> Any:
    from gradpatch import PatchableGraph

    return PatchableGraph(model, ids, use_cache=False)


def _child(name: str, random_weights: bool, freeze: bool) -> None:
    """The fresh process: load the model, extract once, print the timing and the garbage collector's share of it
    (seconds in collections, full collections) as JSON; with ``freeze``, ``gc.freeze()`` after the load (the objects
    of torch, transformers and the model moved out of the collector's reach)."""
    import torch

    model, ids, _ = _model_and_inputs(name, random_weights)
    model.eval()
    with torch.no_grad():
        model(ids, use_cache=False)  # the model's own first-call work (kernels, lazy imports) is not extraction's
    if freeze:
        gc.freeze()
    starts: dict[int, float] = {}
    collected = {"gc_s": 0.0, "full_collections": 0}

    def watch(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            starts[info["generation"]] = time.perf_counter()
        else:
            collected["gc_s"] += time.perf_counter() - starts.pop(info["generation"])
            collected["full_collections"] += info["generation"] == 2

    gc.callbacks.append(watch)
    timings = _timings(lambda: _extract(model, ids), 1)
    gc.callbacks.remove(watch)
    print(json.dumps({**timings, **collected}), flush=True)


def _fresh(name: str, count: int, threads: int, random_weights: bool, freeze: bool = False) -> dict[str, Any]:
    runs = []
    for _ in range(count):
        arguments = (["--child", name, "--threads", str(threads)] + (["--random-weights"] if random_weights else [])
                     + (["--gc-freeze"] if freeze else []))
        stdout = run_module(sys.executable, "benchmarks.engine.extraction", arguments).stdout
        runs.append(json.loads(stdout.strip().splitlines()[-1]))
    return {"runs": count, **{key: round(min(run[key] for run in runs), 4)
                              for key in ("cpu_s_min", "wall_s_min", "gc_s")},
            "full_collections": [run["full_collections"] for run in runs]}


def _fx_mlp_traces(model: Any) -> Callable[[], None]:
    """One plain ``torch.fx`` trace per decoder layer MLP (the deepest modules fx traces whole)."""
    import torch

    mlps = [layer.mlp for layer in model.model.layers]

    def trace_all() -> None:
        for mlp in mlps:
            torch.fx.GraphModule(mlp, torch.fx.Tracer().trace(mlp))

    return trace_all


def _bench(name: str, args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from gradpatch.extraction.reuse import graph_reuse_disabled

    model, ids, source = _model_and_inputs(name, args.random_weights)
    model.eval()
    with torch.no_grad():
        model(ids, use_cache=False)
    fresh = _fresh(name, args.fresh, args.threads, args.random_weights) if args.fresh else None
    frozen = _fresh(name, args.fresh, args.threads, args.random_weights, freeze=True) if args.fresh else None
    _extract(model, ids)  # untimed: this process's first extraction
    repeated = _timings(lambda: _extract(model, ids), args.repeats)
    with graph_reuse_disabled():
        without_reuse = _timings(lambda: _extract(model, ids), args.repeats)
    pg = _extract(model, ids)
    references: dict[str, Any] = {
        "forward": _timings(lambda: model(ids, use_cache=False), args.repeats),
        "fx_tracer": {"modules": len(model.model.layers), **_timings(_fx_mlp_traces(model), args.repeats)},
    }
    if args.export_runs:
        references["torch_export"] = _timings(
            lambda: torch.export.export(model, (ids,), {"use_cache": False}, strict=False), args.export_runs)
    graphs = [module for module in pg.modules() if isinstance(module, torch.fx.GraphModule)]
    return {
        "weights": source,
        "input_shape": list(ids.shape),
        "graphs": len(graphs),
        "fx_nodes": sum(len(module.graph.nodes) for module in graphs),
        "node_paths": len(pg.node_paths()),
        "gradpatch": {"first_in_fresh_process": fresh, "first_in_fresh_process_gc_frozen": frozen,
                      "repeated": repeated,
                      "repeated_without_reuse": without_reuse},
        "reference": references,
        "ratio_repeated_cpu_min_over": {key: round(repeated["cpu_s_min"] / value["cpu_s_min"], 3)
                                        for key, value in {**references, "without_reuse": without_reuse}.items()},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="timed extractions in this process (default 5)")
    parser.add_argument("--fresh", type=int, default=2, help="fresh processes for the first extraction (default 2)")
    parser.add_argument("--export-runs", type=int, default=1, help="torch.export runs (default 1; 0 skips)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--random-weights", action="store_true", help="SmolLM2's config with random weights")
    parser.add_argument("--skip-real", action="store_true", help="skip SmolLM2-135M")
    parser.add_argument("--skip-tiny", action="store_true", help="skip the tiny Llama")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--gc-freeze", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # before torch loads (here and in the subprocesses)
    import torch

    torch.set_num_threads(args.threads)
    if args.child is not None:
        _child(args.child, args.random_weights, args.gc_freeze)
        return 0
    report: dict[str, Any] = {"command": " ".join(["python -m benchmarks.engine.extraction", *(argv or sys.argv[1:])]),
                              "threads": args.threads}
    if not args.skip_tiny:
        report["tiny_llama"] = _bench("tiny_llama", args)
    if not args.skip_real:
        report["smollm2_135m"] = _bench("smollm2", args)
    emit(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
