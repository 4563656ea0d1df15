"""Compiled patched forwards against the compiled plain model (issue 47, T5 and the GPU figures); prints JSON.

On SmolLM2-135M (the embedded GGUF on CPU in float32, else its config with random weights) it compiles with
inductor (``--mode`` for ``reduce-overhead`` on a GPU) and measures, round-robin after a warm-up:

- ``forward``: per shape, under ``torch.no_grad()``, ``torch.compile(model)`` against ``pg.compile()`` running
  ``pg(ids)`` inside ``pg.patch({node: AddPatch(value=zeros)})`` (ratio = patched compiled / plain compiled), and
  the largest |logit difference| between the compiled and the eager patched graph;
- ``forward_backward``: a loss on the last position's log-probabilities and its backward to an AddPatch delta,
  ``pg.compile()`` with the delta as a patch against ``torch.compile(model)`` with the same delta added by a forward
  hook on the same module (ratio = patched / hooked), and the gradients' relative difference;
- ``cold_compile``: seconds of the first compiled call of each (plain model, patched graph) at the first shape, and
  their ratio.

- ``exactness`` (T1): the issue's sequence of patch sets — no patch, Zero at A, Add at A, Probe at A, sliced Add at B,
  no patch, Add at A (A the node below, B the next block's output) — through ``pg.compile(fullgraph=True)`` with a
  backend that runs dynamo's graphs as traced (any difference is the patch handling's, not a kernel's), against the
  eager graph: the largest |logit difference| and probe difference per step, the number of graphs
  compiled after each step, and the relative difference of an AddPatch value's gradient.

``node = model.layers_<mid>.mlp.down_proj.output``. Medians over ``--runs`` rounds; every ratio is from this run.

Inductor's caches are off (``TORCHINDUCTOR_FORCE_DISABLE_CACHES=1`` unless set otherwise), so that neither cold
compile reuses kernels the other built.

Run: ``.venv/bin/python -m benchmarks.engine.compile_overhead [--shapes 1x32,8x128] [--runs 20] [--device cuda]
[--dtype bfloat16] [--mode reduce-overhead] [--dynamic] [--random-weights] [--skip exactness,speed,backward]``. Without
``--dynamic`` every compile is static (``dynamic=False``: one compile per shape, for plain and patched alike).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "1")  # before torch reads its configuration

import torch  # noqa: E402
from torch import nn  # noqa: E402

from benchmarks.harness import emit
from gradpatch import AddPatch, PatchableGraph, ProbePatch, ZeroPatch
from gradpatch.files.loaders import WEIGHT_DTYPES as DTYPES, embedded_or_random_model


def _timed(fn: Callable[[], Any], synchronize: Callable[[], None]) -> float:
    synchronize()
    start = time.perf_counter()
    fn()
    synchronize()
    return time.perf_counter() - start


def _round_robin(variants: dict[str, Callable[[], Any]], runs: int, warmup: int,
                 synchronize: Callable[[], None]) -> dict[str, float]:
    """Median seconds of each variant, one call of each per round."""
    times: dict[str, list[float]] = {name: [] for name in variants}
    for round_index in range(warmup + runs):
        for name, fn in variants.items():
            elapsed = _timed(fn, synchronize)
            if round_index >= warmup:
                times[name].append(elapsed)
    return {name: statistics.median(values) for name, values in times.items()}


def _last_position_loss(logits: torch.Tensor) -> torch.Tensor:
    return -torch.log_softmax(logits[:, -1].float(), dim=-1)[:, :8].sum()


class CountingBackend:
    """A torch.compile backend that counts the graphs dynamo hands it and runs them as traced."""

    def __init__(self) -> None:
        self.graphs = 0

    def __call__(self, graph_module: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        self.graphs += 1
        return graph_module.forward


def exactness(model: nn.Module, ids: torch.Tensor, node: str, block_output: str) -> dict[str, Any]:
    """T1 on ``model``: the issue's sequence of patch sets, compiled against eager (see the module docstring)."""
    torch.compiler.reset()
    eager = PatchableGraph(model, ids, use_cache=False)
    pg = PatchableGraph(model, ids, use_cache=False)
    counter = CountingBackend()
    pg.compile(backend=counter, fullgraph=True)
    width = model.config.hidden_size
    value = torch.randn(width, generator=torch.Generator().manual_seed(1)).to(ids.device)
    sequence = [("no patch", {}), ("Zero at A", {node: ZeroPatch()}), ("Add at A", {node: AddPatch(value=value)}),
                ("Probe at A", {node: ProbePatch()}),
                ("sliced Add at B", {block_output: AddPatch(value=value, slice=(slice(None), 2))}),
                ("no patch", {}), ("Add at A", {node: AddPatch(value=value)})]
    steps = []
    with torch.no_grad():
        for name, patches in sequence:
            with eager.patch(patches):
                expected = eager(ids, use_cache=False).logits
                probes = [p.activation for p in patches.values() if isinstance(p, ProbePatch)]
            with pg.patch(patches):
                got = pg(ids, use_cache=False).logits
            probe_difference = [float((p.activation - q).abs().max())
                                for p, q in zip([p for p in patches.values() if isinstance(p, ProbePatch)], probes)]
            steps.append({"patches": name, "max_abs_diff": float((got - expected).abs().max()),
                          "probe_max_abs_diff": probe_difference, "graphs_compiled": counter.graphs})
    delta = torch.zeros(width, device=ids.device, requires_grad=True)
    gradients = []
    for graph in (eager, pg):
        with graph.patch({node: AddPatch(value=delta)}):
            _last_position_loss(graph(ids, use_cache=False).logits).backward()
        gradients.append(delta.grad.clone())
        delta.grad = None
    return {"backend": "dynamo graphs run as traced", "shape": list(ids.shape), "steps": steps,
            "gradient_relative_difference": float((gradients[1] - gradients[0]).norm() / gradients[0].norm())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="1x32,8x128")
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    parser.add_argument("--mode", default=None, help="torch.compile mode (e.g. reduce-overhead on a GPU)")
    parser.add_argument("--dynamic", action="store_true",
                        help="torch.compile's default shape handling (automatic dynamic shapes after a second shape) "
                             "instead of one static compile per shape")
    parser.add_argument("--random-weights", action="store_true")
    parser.add_argument("--skip", default="", help="comma-separated sections to skip: exactness, speed, backward")
    args = parser.parse_args()
    shapes = [tuple(int(n) for n in shape.split("x")) for shape in args.shapes.split(",")]
    dtype = DTYPES[args.dtype]
    model, weights = embedded_or_random_model(dtype=dtype, device=args.device, random_weights=args.random_weights)
    model.eval().requires_grad_(False)
    synchronize = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    generator = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    inputs = [torch.randint(0, vocab, shape, generator=generator).to(args.device) for shape in shapes]
    mid = len(model.model.layers) // 2
    node = f"model.layers_{mid}.mlp.down_proj.output"
    hooked_module: nn.Module = model.model.layers[mid].mlp.down_proj
    compile_kwargs: dict[str, Any] = {} if args.dynamic else {"dynamic": False}
    if args.mode is not None:
        compile_kwargs["mode"] = args.mode
    skip = set(filter(None, args.skip.split(",")))
    report: dict[str, Any] = {"benchmark": "compile_overhead", "weights": weights, "device": args.device,
                              "dtype": args.dtype, "compile_kwargs": compile_kwargs, "torch": torch.__version__,
                              "machine": platform.machine(), "threads": torch.get_num_threads(), "node": node}
    if "exactness" not in skip:
        report["exactness"] = exactness(model, inputs[0], node, f"model.layers_{mid + 1}.output")
    if "speed" not in skip:
        report.update(speed(model, inputs, node, hooked_module, compile_kwargs, args.runs, args.warmup,
                            synchronize, backward="backward" not in skip))
    emit(report, device=args.device)


def speed(model: nn.Module, inputs: list[torch.Tensor], node: str, hooked_module: nn.Module,
          compile_kwargs: dict[str, Any], runs: int, warmup: int, synchronize: Callable[[], None],
          backward: bool = True) -> dict[str, Any]:
    """The ``cold_compile``, ``forward`` and (with ``backward``) ``forward_backward`` sections (see the module
    docstring)."""
    torch.compiler.reset()
    width = model.config.hidden_size
    dtype = next(model.parameters()).dtype
    device = inputs[0].device

    eager = PatchableGraph(model, inputs[0], use_cache=False)
    pg = PatchableGraph(model, inputs[0], use_cache=False)
    pg.compile(**compile_kwargs)
    plain = torch.compile(model, **compile_kwargs)
    zeros = torch.zeros(width, dtype=dtype, device=device)
    report: dict[str, Any] = {}
    with torch.no_grad():
        cold_plain = _timed(lambda: plain(inputs[0], use_cache=False), synchronize)
        with pg.patch({node: AddPatch(value=zeros)}):
            cold_patched = _timed(lambda: pg(inputs[0], use_cache=False), synchronize)
    report["cold_compile"] = {"plain_s": round(cold_plain, 2), "patched_s": round(cold_patched, 2),
                              "ratio": round(cold_patched / cold_plain, 3)}

    forward = []
    for ids in inputs:
        delta = torch.randn(width, generator=torch.Generator().manual_seed(2)).to(device, dtype) * 0.1
        with torch.no_grad():
            with pg.patch({node: AddPatch(value=delta)}):
                compiled_logits = pg(ids, use_cache=False).logits.clone()  # reduce-overhead reuses its output
            with eager.patch({node: AddPatch(value=delta)}):
                eager_logits = eager(ids, use_cache=False).logits
            with pg.patch({node: AddPatch(value=zeros)}):
                medians = _round_robin({"plain": lambda: plain(ids, use_cache=False),
                                        "patched": lambda: pg(ids, use_cache=False)},
                                       runs, warmup, synchronize)
        forward.append({"shape": list(ids.shape), "plain_compiled_ms": round(medians["plain"] * 1e3, 3),
                        "patched_compiled_ms": round(medians["patched"] * 1e3, 3),
                        "ratio": round(medians["patched"] / medians["plain"], 4),
                        "max_abs_diff_vs_eager": float((compiled_logits - eager_logits).abs().max())})
    report["forward"] = forward
    if not backward:
        return report

    ids = inputs[-1]
    delta = torch.zeros(width, dtype=dtype, device=device, requires_grad=True)
    handle = hooked_module.register_forward_hook(lambda module, inputs_, output: output + delta)
    hooked = torch.compile(model, **compile_kwargs)
    try:
        def hooked_step() -> torch.Tensor:
            delta.grad = None
            _last_position_loss(hooked(ids, use_cache=False).logits).backward()
            return delta.grad

        with pg.patch({node: AddPatch(value=delta)}):
            def patched_step() -> torch.Tensor:
                delta.grad = None
                _last_position_loss(pg(ids, use_cache=False).logits).backward()
                return delta.grad

            gradient_patched = patched_step().clone()
            gradient_hooked = hooked_step().clone()
            medians = _round_robin({"hooked": hooked_step, "patched": patched_step}, runs, warmup, synchronize)
    finally:
        handle.remove()
    report["forward_backward"] = {
        "shape": list(ids.shape), "hooked_compiled_ms": round(medians["hooked"] * 1e3, 3),
        "patched_compiled_ms": round(medians["patched"] * 1e3, 3),
        "ratio": round(medians["patched"] / medians["hooked"], 4),
        "gradient_relative_difference": float((gradient_patched - gradient_hooked).norm()
                                              / gradient_hooked.norm())}
    return report


if __name__ == "__main__":
    main()
