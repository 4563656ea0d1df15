"""Forward-pass overhead of PatchableGraph against the original model, on CPU or a GPU; prints JSON.

For a tiny random Llama (CPU only) and for SmolLM2-135M-Instruct it measures, under ``torch.no_grad()``, the
median wall time of:

- ``plain``: the original ``model(input_ids, use_cache=False)``;
- ``no_patch``: ``pg(input_ids, use_cache=False)`` outside any patch;
- ``probe``: the same inside ``pg.patch({node: ProbePatch()})``;
- ``add``: the same inside ``pg.patch({node: AddPatch(value=zeros)})``;

with ``node = model.layers_<mid>.mlp.down_proj.output``. The four are measured round-robin (one call of each per
round) after a warm-up, so drift affects them alike; ratios are medians over the plain median, all from this run.
Patch contexts are entered before the timer starts; on a GPU each call is timed up to ``torch.cuda.synchronize()``.
Each shape also reports ``max_abs_diff`` between the plain and the graph's logits (0.0: bit-identical). With
``--device cuda`` the report gives the GPU memory allocated by the model and the extra allocated by building the
PatchableGraph (``graph_memory_ratio``: allocated after construction over the model's own, both after one plain
forward, so the cuBLAS workspace that the first matmul allocates counts as the model's).

SmolLM2 uses the embedded GGUF weights on CPU in float32; with ``--random-weights``, another ``--dtype`` or
``--device cuda``, or when the GGUF is not installed, it is built from the embedded model's config with random
weights (the shapes are what speed depends on).

Run: ``.venv/bin/python -m benchmarks.engine.forward_overhead [--device cuda] [--dtype bfloat16] [--shapes 1x10,8x128]
[--skip-real] [--runs N]``.
"""

from __future__ import annotations

import argparse
import contextlib
import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from benchmarks.harness import emit
from gradpatch.testing import tiny_llama
from gradpatch import AddPatch, PatchableGraph, ProbePatch
from gradpatch.files.loaders import WEIGHT_DTYPES as DTYPES, embedded_or_random_model


def _count_nodes(pg: PatchableGraph) -> dict[str, int]:
    """Node counts: NodePaths of the tree, fx graph nodes over all extracted graphs, lines of the drawn tree."""
    return {
        "node_paths": len(pg.node_paths()),
        "fx_nodes": sum(len(m.graph.nodes) for m in pg.modules() if isinstance(m, torch.fx.GraphModule)),
        "tree_lines": len(repr(pg.graph).splitlines()),
    }


def _time_call(fn: Callable[[], Any], context: Callable[[], contextlib.AbstractContextManager[Any]],
               synchronize: Callable[[], None]) -> float:
    """Seconds taken by ``fn()`` (until ``synchronize()`` returns), timed inside (not including) ``context()``."""
    with context():
        synchronize()
        t0 = time.perf_counter()
        fn()
        synchronize()
        return time.perf_counter() - t0


def bench_shape(model: nn.Module, pg: PatchableGraph, input_ids: torch.Tensor, *, runs: int, warmup: int
                ) -> dict[str, Any]:
    """Time the four variants on one input shape; see the module docstring."""
    synchronize = torch.cuda.synchronize if input_ids.is_cuda else (lambda: None)
    node = f"model.layers_{len(model.model.layers) // 2}.mlp.down_proj.output"
    with torch.no_grad():
        plain_logits = model(input_ids, use_cache=False).logits
        probe = ProbePatch()
        with pg.patch({node: probe}):
            graph_logits = pg(input_ids, use_cache=False).logits
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
                elapsed = _time_call(fn, ctx, synchronize)
                if i >= warmup:
                    times[name].append(elapsed)
    med = {k: statistics.median(v) for k, v in times.items()}
    result: dict[str, Any] = {
        "shape": list(input_ids.shape),
        "patched_node": node,
        "runs": runs,
        **{f"{name}_ms": value * 1e3 for name, value in med.items()},
        **{f"{name}_ratio": med[name] / med["plain"] for name in ("no_patch", "probe", "add")},
        "max_abs_diff": float((plain_logits.float() - graph_logits.float()).abs().max()),
    }
    return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in result.items()}


def bench_model(model: nn.Module, shapes: list[tuple[int, int]], *, vocab: int, runs: int, warmup: int,
                construct_runs: int) -> dict[str, Any]:
    """Build the PatchableGraph (timed) on the first shape, then time every shape; see the module docstring."""
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(0)
    inputs = [torch.randint(0, vocab, shape, generator=generator).to(device) for shape in shapes]
    cuda = device.type == "cuda"
    if cuda:  # the first matmul allocates cuBLAS's workspace (32 MiB on Hopper) through torch's allocator: count it
        with torch.no_grad():  # on both sides of the ratio, not as graph memory
            model(inputs[0], use_cache=False)
        torch.cuda.synchronize(device)
    model_bytes = torch.cuda.memory_allocated(device) if cuda else 0
    construct_times = []
    pg = None
    for _ in range(construct_runs):
        pg = None
        t0 = time.perf_counter()
        pg = PatchableGraph(model, inputs[0], use_cache=False)
        construct_times.append(time.perf_counter() - t0)
    assert pg is not None
    result: dict[str, Any] = {"construction_s": round(statistics.median(construct_times), 4),
                              "construction_runs": construct_runs}
    if cuda:
        graph_bytes = torch.cuda.memory_allocated(device)
        result.update({"model_memory_mib": round(model_bytes / 2**20, 1),
                       "after_construction_mib": round(graph_bytes / 2**20, 1),
                       "graph_memory_ratio": round(graph_bytes / model_bytes, 4)})
    result["shapes"] = [bench_shape(model, pg, ids, runs=runs, warmup=warmup) for ids in inputs]
    result.update(_count_nodes(pg))
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="weight dtype (default float32)")
    parser.add_argument("--shapes", default=None,
                        help="batch x tokens, comma separated (default: 1x10 on CPU, 1x10,8x128 on a GPU)")
    parser.add_argument("--random-weights", action="store_true", help="SmolLM2's config with random weights")
    parser.add_argument("--skip-real", action="store_true", help="skip SmolLM2-135M (saves ~30 s of loading)")
    parser.add_argument("--skip-tiny", action="store_true", help="skip the tiny Llama")
    parser.add_argument("--runs", type=int, default=None, help="timed rounds (default: 100 tiny, 20 real, 50 GPU)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed rounds first (default: 5)")
    parser.add_argument("--real-construct-runs", type=int, default=1, help="constructions to time on SmolLM2 (1-3)")
    args = parser.parse_args(argv)
    dtype = DTYPES[args.dtype]
    cuda = args.device.startswith("cuda")
    shapes = [tuple(int(part) for part in item.split("x")) for item in
              (args.shapes or ("1x10,8x128" if cuda else "1x10")).split(",")]

    torch.set_num_threads(2)
    report: dict[str, Any] = {"torch": torch.__version__, "python": platform.python_version(),
                              "threads": torch.get_num_threads(), "device": args.device, "dtype": args.dtype}
    if cuda:
        report["gpu"] = torch.cuda.get_device_name(args.device)
    if not args.skip_tiny:
        tiny = tiny_llama(1000, hidden=64, intermediate=128, init_std=0.02).to(args.device, dtype)
        report["tiny_llama"] = bench_model(tiny, [(1, 16)], vocab=1000, runs=args.runs or 100, warmup=args.warmup,
                                           construct_runs=3)
    if not args.skip_real:
        model, source = embedded_or_random_model(dtype, args.device, args.random_weights)
        report["smollm2_135m"] = {"weights": source, **bench_model(
            model, shapes, vocab=model.config.vocab_size, runs=args.runs or (50 if cuda else 20), warmup=args.warmup,
            construct_runs=args.real_construct_runs)}
    emit(report, device=args.device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
