"""One patched forward, compiled and not, in gradpatch, plain PyTorch hooks and nnsight 0.8 (issue 47's side by side).

The patch: a fixed random delta ``[hidden]`` (seed 0, times 0.1) added to the output of
``model.model.layers[L].mlp.down_proj`` (gradpatch's ``model.layers_L.mlp.down_proj.output``, ``--layer``, 15 by
default), on SmolLM2-135M (``gradpatch.files.loaders.embedded_or_random_model()``: the embedded GGUF in float32 on CPU,
else its config with random weights), under ``torch.no_grad()``, inductor on CPU, default ``torch.compile``
arguments (``fullgraph=False``, ``dynamic=None``). Per shape (``--shapes``, 1x32 and 8x128 by default) it runs:

1. ``gradpatch_eager``: ``pg(ids, use_cache=False)`` inside ``pg.patch({node: AddPatch(value=delta)})``;
2. ``gradpatch_compiled``: the same on a second PatchableGraph after ``pg.compile()``;
3. ``hook_eager``: a copy of the model with a forward hook on ``down_proj`` returning ``output + delta``;
4. ``hook_compiled``: ``torch.compile`` of that hooked copy;
5. ``nnsight_eager``: nnsight 0.8.1, ``NNsight(model)`` and ``with lm.trace(ids, use_cache=False):`` setting
   ``down_proj.output = down_proj.output + delta`` and saving the logits;
6. ``nnsight_compiled``: the same on a copy compiled in place (``model.compile()``, torch's defaults, so
   ``fullgraph=False``) and then wrapped by ``NNsight``; nnsight 0.8.1 has no compile option of its own (see
   ``NNSIGHT_COMPILE_NOTE``);
7. ``plain_compiled``: ``torch.compile`` of the model without any patch, the baseline of every ratio.

Equal outputs first: ``max_abs_diff_vs_hook_eager`` is the largest |logit difference| of each variant from
``hook_eager`` in this process (``patch_effect``: how far ``hook_eager`` is from the unpatched eager model, so a
patch that did nothing would show). Then the median milliseconds of a call over ``--runs`` rounds after
``--warmup`` rounds, one call of each variant per round (round robin), and ``ratio_vs_plain_compiled`` against
``plain_compiled`` timed in the same rounds. ``cold_compile_s``: seconds of the first call of each compiled variant
at that shape (compiled in the order plain, hook, gradpatch, then nnsight in its own process), with dynamo's counts
for it (graphs, graph breaks, functions that hit dynamo's recompile limit and run eagerly from then on).

Dynamo is made to guard on module hooks (``torch._dynamo.config.skip_nnmodule_hook_guards = False``, both processes;
``--torch-default-hook-guards`` keeps torch's default): with the default, the hooked copy reuses the code compiled for
the plain model and the hook is silently dropped (0.235 max |logit difference| at 1x8, random weights). Every shape
compiles from scratch (``torch.compiler.reset()``, static shapes), with inductor's FX-graph and AOTAutograd caches off
and every cold compile in ``torch._inductor.utils.fresh_cache()``, so no variant reuses another's kernels.

nnsight lives in its own virtualenv, never a dependency (``make peers PEERS=nnsight`` builds ``.peers/nnsight`` from
``benchmarks/peers/nnsight/requirements.txt``: torch 2.13.0, nnsight 0.8.1, transformers 5.24.0). This script
measures 1-4 and 7, saves the model, inputs, delta and ``hook_eager`` logits to a temporary folder and runs
``benchmarks/peers/nnsight/compile_side.py`` under nnsight's Python (``--peer-python`` names another), which measures
5, 6, its own ``plain_compiled`` and ``hook_eager`` (the weights travelled intact when its logits equal this side's).
What both processes share is benchmarks/engine/compile_probe.py. One invocation prints both sides' JSON.

Run: ``OMP_NUM_THREADS=2 .venv/bin/python -m benchmarks.engine.compile_peers [--shapes 1x32,8x128] [--runs 10]
[--warmup 2] [--layer 15] [--random-weights] [--peer-python PYTHON] [--no-nnsight]``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.engine.compile_probe import (INDUCTOR_DIR, cold, guard_hooks, hooked_copy, max_diff,  # before torch
                                             variant_rows)
from benchmarks.harness import emit, peer_python, round_robin, run_module, save_for_peers

import torch  # noqa: E402,I001
from safetensors.torch import save_file  # noqa: E402

from gradpatch import AddPatch, PatchableGraph  # noqa: E402
from gradpatch.files.loaders import embedded_or_random_model  # noqa: E402

DELTA_SCALE = 0.1


def shapes_of(text: str) -> list[tuple[int, int]]:
    """``"1x32,8x128"`` -> ``[(1, 32), (8, 128)]`` (batch x sequence)."""
    return [tuple(int(n) for n in shape.split("x")) for shape in text.split(",")]  # type: ignore[misc]


def _run_peer(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """nnsight's side (benchmarks/peers/nnsight/compile_side.py) on ``workdir``, in nnsight's virtualenv; its JSON
    report, or the error when it failed."""
    arguments = ["--workdir", str(workdir), "--shapes", args.shapes, "--runs", str(args.runs), "--warmup",
                 str(args.warmup), "--layer", str(args.layer)]
    if args.torch_default_hook_guards:
        arguments.append("--torch-default-hook-guards")
    env = dict(os.environ)
    if INDUCTOR_DIR is not None and env.get("TORCHINDUCTOR_CACHE_DIR") == INDUCTOR_DIR:
        env.pop("TORCHINDUCTOR_CACHE_DIR")  # the peer makes its own cold cache
    start = time.perf_counter()
    result = run_module(peer_python("nnsight", args.peer_python), "benchmarks.peers.nnsight.compile_side", arguments,
                        env=env, check=False)
    if result.returncode != 0:
        return {"error": f"exit status {result.returncode}", "stderr_tail": result.stderr[-4000:]}
    report = json.loads(result.stdout)
    report["process_wall_s"] = round(time.perf_counter() - start, 1)
    return report


def gradpatch_side(args: argparse.Namespace) -> dict[str, Any]:
    """Measure the gradpatch process's variants per shape, then nnsight's side on the same model and inputs (unless
    ``--no-nnsight``); the report of both (module docstring)."""
    hook_guards = guard_hooks(args.torch_default_hook_guards)
    load_start = time.perf_counter()
    model, weights = embedded_or_random_model(random_weights=args.random_weights)
    model.eval().requires_grad_(False)
    load_s = time.perf_counter() - load_start
    layer = args.layer
    width = model.config.hidden_size
    node = f"model.layers_{layer}.mlp.down_proj.output"
    delta = torch.randn(width, generator=torch.Generator().manual_seed(0)) * DELTA_SCALE
    generator = torch.Generator().manual_seed(0)
    inputs = [torch.randint(0, model.config.vocab_size, shape, generator=generator) for shape in shapes_of(args.shapes)]

    hooked = hooked_copy(model, layer, delta)
    eager_pg = PatchableGraph(model, inputs[0], use_cache=False)
    pg = PatchableGraph(model, inputs[0], use_cache=False)
    pg.compile()

    workdir = Path(tempfile.mkdtemp(prefix="compile_peers_"))
    try:
        if not args.no_nnsight:
            save_for_peers(model, None, workdir / "model")
        report: dict[str, Any] = {
            "benchmark": "compile_peers", "weights": weights, "model": type(model).__name__,
            "layers": model.config.num_hidden_layers, "layer": layer, "node": node, "delta": f"randn({width}, seed 0)"
            f" * {DELTA_SCALE}", "dynamo_guards_on_hooks": hook_guards, "runs": args.runs, "warmup": args.warmup,
            "load_s": round(load_s, 1), "shapes": {}}
        references: list[torch.Tensor] = []
        gradpatch_shapes: list[dict[str, Any]] = []
        for ids in inputs:
            torch.compiler.reset()
            shape_report: dict[str, Any] = {}
            with torch.no_grad(), contextlib.ExitStack() as stack:
                plain = torch.compile(model)
                hooked_compiled = torch.compile(hooked)
                stack.enter_context(eager_pg.patch({node: AddPatch(value=delta)}))
                stack.enter_context(pg.patch({node: AddPatch(value=delta)}))
                variants: dict[str, Callable[[], Any]] = {
                    "gradpatch_eager": lambda: eager_pg(ids, use_cache=False).logits,
                    "gradpatch_compiled": lambda: pg(ids, use_cache=False).logits,
                    "hook_eager": lambda: hooked(ids, use_cache=False).logits,
                    "hook_compiled": lambda: hooked_compiled(ids, use_cache=False).logits,
                    "plain_compiled": lambda: plain(ids, use_cache=False).logits,
                }
                colds = {name: cold(variants[name])
                         for name in ("plain_compiled", "hook_compiled", "gradpatch_compiled")}
                reference = variants["hook_eager"]()
                unpatched = model(ids, use_cache=False).logits
                shape_report["patch_effect"] = max_diff(reference, unpatched)
                shape_report["plain_compiled_vs_unpatched_eager"] = max_diff(variants["plain_compiled"](), unpatched)
                diffs = {name: max_diff(fn(), reference) for name, fn in variants.items() if name != "plain_compiled"}
                del unpatched
                medians = round_robin(variants, args.runs, args.warmup)
            shape_report["variants"] = variant_rows(medians, diffs, colds)
            gradpatch_shapes.append(shape_report)
            references.append(reference)
        torch.compiler.reset()
        for ids, shape_report in zip(inputs, gradpatch_shapes):
            report["shapes"]["x".join(map(str, ids.shape))] = {"gradpatch_process": shape_report}
        if args.no_nnsight:
            return report
        save_file({"delta": delta, **{f"ids_{i}": ids for i, ids in enumerate(inputs)},
                   **{f"reference_{i}": ref.contiguous() for i, ref in enumerate(references)}},
                  str(workdir / "tensors.safetensors"))
        del references
        peer = _run_peer(args, workdir)
        report["nnsight_process"] = {key: value for key, value in peer.items() if key != "shapes"}
        for key, shape_report in (peer.get("shapes") or {}).items():
            report["shapes"].setdefault(key, {})["nnsight_process"] = shape_report
        report["summary"] = _summary(report)
        return report
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _summary(report: dict[str, Any]) -> dict[str, Any]:
    """Per shape, the seven variants in one table: ms, ratio against the plain compiled model of its own process,
    max |logit difference| from hook_eager, cold compile seconds."""
    table: dict[str, Any] = {}
    order = ["gradpatch_eager", "gradpatch_compiled", "hook_eager", "hook_compiled", "nnsight_eager",
             "nnsight_compiled", "plain_compiled"]
    for shape, sides in report["shapes"].items():
        rows: dict[str, Any] = {}
        for name in order:
            side = "nnsight_process" if name.startswith("nnsight") else "gradpatch_process"
            entry = (sides.get(side) or {}).get("variants", {}).get(name)
            if entry is None:
                continue
            rows[name] = {key: entry[key] for key in ("ms", "ratio_vs_plain_compiled", "max_abs_diff_vs_hook_eager",
                                                      "cold_compile_s") if key in entry}
        table[shape] = rows
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="1x32,8x128")
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--layer", type=int, default=15)
    parser.add_argument("--random-weights", action="store_true")
    parser.add_argument("--peer-python", default=None,
                        help="interpreter of the nnsight virtualenv (default: .peers/nnsight/bin/python)")
    parser.add_argument("--torch-default-hook-guards", action="store_true",
                        help="leave torch._dynamo.config.skip_nnmodule_hook_guards at torch's default (True): "
                             "hook_compiled then reuses plain_compiled's code and drops the hook")
    parser.add_argument("--no-nnsight", action="store_true", help="measure the gradpatch process's variants only")
    emit(gradpatch_side(parser.parse_args()))


if __name__ == "__main__":
    main()
