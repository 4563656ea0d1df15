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

nnsight lives in its own virtualenv, never a dependency (``python3 -m venv /work/peers/nnsight &&
/work/peers/nnsight/bin/pip install "torch==2.13.0" nnsight==0.8.1 transformers==5.24.0``). This script measures
1-4 and 7, saves the model, inputs, delta and ``hook_eager`` logits to a temporary folder and runs itself with
``--side nnsight`` under ``--peer-python``, which measures 5, 6, its own ``plain_compiled`` and ``hook_eager`` (the
weights travelled intact when its logits equal this side's). One invocation prints both sides' JSON.

Run: ``OMP_NUM_THREADS=2 .venv/bin/python benchmarks/compile_peers.py [--shapes 1x32,8x128] [--runs 10]
[--warmup 2] [--layer 15] [--random-weights] [--peer-python /work/peers/nnsight/bin/python] [--no-nnsight]``.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import copy
import json
import logging
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# Before torch is imported: a cold, private inductor cache for this process and no reuse of whole graphs.
os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "0")
os.environ.setdefault("TORCHINDUCTOR_AUTOGRAD_CACHE", "0")
if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    _INDUCTOR_DIR = tempfile.mkdtemp(prefix="compile_peers_inductor_")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = _INDUCTOR_DIR
    atexit.register(shutil.rmtree, _INDUCTOR_DIR, True)

import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from torch._dynamo import config as dynamo_config  # noqa: E402
from torch._inductor.utils import fresh_cache  # noqa: E402

DEFAULT_PEER_PYTHON = "/work/peers/nnsight/bin/python"
DELTA_SCALE = 0.1

#: What nnsight says about torch.compile (checked against the sources named; reported in the JSON).
NNSIGHT_COMPILE_NOTE = (
    "nnsight 0.8.1 has no torch.compile option and never sets fullgraph; its one mention of torch.compile "
    "(nnsight/intervention/source.py, module_body) keeps a compiled forward as the body it runs. 'Forces "
    "fullgraph=False' is nnsight <= 0.7's LanguageModel._patch_generation_config (src/nnsight/modeling/language.py, "
    "for transformers' compiled generate); NNsight.md: 'Models cannot be used with torch.compile(fullgraph=True) "
    "because fullgraph compilation doesn't allow hooks.' A forward is compiled here as the model itself, in place.")


def _timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _round_robin(variants: dict[str, Callable[[], Any]], runs: int, warmup: int) -> dict[str, float]:
    """Median seconds of each variant, one call of each per round."""
    times: dict[str, list[float]] = {name: [] for name in variants}
    for round_index in range(warmup + runs):
        for name, fn in variants.items():
            elapsed = _timed(fn)
            if round_index >= warmup:
                times[name].append(elapsed)
    return {name: statistics.median(values) for name, values in times.items()}


class _RecompileLimitHits(logging.Handler):
    """Collects the functions dynamo names when it hits its recompile limit (they run eagerly from then on)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.functions: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if str(record.msg).startswith("torch._dynamo hit config.") and len(record.args or ()) >= 3:
            self.functions.append(str(record.args[2]))  # type: ignore[index]


_LIMIT_HITS = _RecompileLimitHits()
logging.getLogger("torch._dynamo.convert_frame").addHandler(_LIMIT_HITS)


def _dynamo_snapshot() -> tuple[int, int, int]:
    from torch._dynamo.utils import counters
    return (int(counters["stats"]["unique_graphs"]), int(sum(counters["graph_break"].values())),
            len(_LIMIT_HITS.functions))


def _cold(fn: Callable[[], Any]) -> dict[str, Any]:
    """Seconds of the first (compiling) call, in an empty inductor cache (``fresh_cache``: a new cache directory and
    no kernels in memory, so nothing compiled for an earlier variant is reused), with dynamo's counts for it."""
    before = _dynamo_snapshot()
    with fresh_cache():
        seconds = _timed(fn)
    after = _dynamo_snapshot()
    hits = _LIMIT_HITS.functions[before[2]:after[2]]
    return {"cold_compile_s": round(seconds, 2), "graphs": after[0] - before[0],
            "graph_breaks": after[1] - before[1], "recompile_limit_hits": len(hits),
            "recompile_limit_functions": sorted(set(hits))}


def _guard_hooks(args: argparse.Namespace) -> bool:
    """Make dynamo guard on module hooks (see the module docstring); returns the setting in force."""
    if not args.torch_default_hook_guards:
        dynamo_config.skip_nnmodule_hook_guards = False
    return not dynamo_config.skip_nnmodule_hook_guards


def _max_diff(logits: torch.Tensor, reference: torch.Tensor) -> float:
    return float((logits.float() - reference.float()).abs().max())


def _shapes(text: str) -> list[tuple[int, int]]:
    return [tuple(int(n) for n in shape.split("x")) for shape in text.split(",")]  # type: ignore[misc]


def _hooked_copy(model: torch.nn.Module, layer: int, delta: torch.Tensor) -> torch.nn.Module:
    hooked = copy.deepcopy(model)
    hooked.model.layers[layer].mlp.down_proj.register_forward_hook(lambda module, inputs, output: output + delta)
    return hooked


# ----------------------------------------------------------------------------------------------- gradpatch side


def _run_peer(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    command = [args.peer_python, str(Path(__file__).resolve()), "--side", "nnsight", "--workdir", str(workdir),
               "--shapes", args.shapes, "--runs", str(args.runs), "--warmup", str(args.warmup),
               "--layer", str(args.layer)]
    if args.torch_default_hook_guards:
        command.append("--torch-default-hook-guards")
    env = dict(os.environ)
    if env.get("TORCHINDUCTOR_CACHE_DIR") == globals().get("_INDUCTOR_DIR"):
        env.pop("TORCHINDUCTOR_CACHE_DIR")  # the peer makes its own cold cache
    start = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, env=env)
    if result.returncode != 0:
        return {"error": f"exit status {result.returncode}", "command": command,
                "stderr_tail": result.stderr[-4000:]}
    report = json.loads(result.stdout)
    report["process_wall_s"] = round(time.perf_counter() - start, 1)
    return report


def gradpatch_side(args: argparse.Namespace) -> dict[str, Any]:
    if __package__ in (None, ""):  # run as a script: make the repository root importable without an install
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from benchmarks.das_country import save_for_peers  # the model as a plain from_pretrained folder
    from gradpatch import AddPatch, PatchableGraph
    from gradpatch.files.loaders import embedded_or_random_model

    hook_guards = _guard_hooks(args)
    load_start = time.perf_counter()
    model, weights = embedded_or_random_model(random_weights=args.random_weights)
    model.eval().requires_grad_(False)
    load_s = time.perf_counter() - load_start
    layer = args.layer
    width = model.config.hidden_size
    node = f"model.layers_{layer}.mlp.down_proj.output"
    delta = torch.randn(width, generator=torch.Generator().manual_seed(0)) * DELTA_SCALE
    generator = torch.Generator().manual_seed(0)
    inputs = [torch.randint(0, model.config.vocab_size, shape, generator=generator) for shape in _shapes(args.shapes)]

    hooked = _hooked_copy(model, layer, delta)
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
            f" * {DELTA_SCALE}", "torch": torch.__version__, "transformers": __import__("transformers").__version__,
            "python": platform.python_version(), "machine": platform.machine(), "threads": torch.get_num_threads(),
            "dynamo_guards_on_hooks": hook_guards, "runs": args.runs, "warmup": args.warmup,
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
                cold = {"plain_compiled": _cold(variants["plain_compiled"]),
                        "hook_compiled": _cold(variants["hook_compiled"]),
                        "gradpatch_compiled": _cold(variants["gradpatch_compiled"])}
                reference = variants["hook_eager"]()
                unpatched = model(ids, use_cache=False).logits
                shape_report["patch_effect"] = _max_diff(reference, unpatched)
                shape_report["plain_compiled_vs_unpatched_eager"] = _max_diff(variants["plain_compiled"](), unpatched)
                diffs = {name: _max_diff(fn(), reference) for name, fn in variants.items() if name != "plain_compiled"}
                del unpatched
                medians = _round_robin(variants, args.runs, args.warmup)
            base = medians["plain_compiled"]
            shape_report["variants"] = {
                name: {"ms": round(medians[name] * 1e3, 2), "ratio_vs_plain_compiled": round(medians[name] / base, 4),
                       **({"max_abs_diff_vs_hook_eager": diffs[name]} if name in diffs else {}),
                       **cold.get(name, {})}
                for name in variants}
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


# ------------------------------------------------------------------------------------------------- nnsight side


def _nnsight_logits(lm: Any, ids: torch.Tensor, layer: int, delta: torch.Tensor) -> torch.Tensor:
    with lm.trace(ids, use_cache=False):
        down_proj = lm.model.layers[layer].mlp.down_proj
        down_proj.output = down_proj.output + delta
        logits = lm.output.logits.save()
    return logits


def nnsight_side(args: argparse.Namespace) -> dict[str, Any]:
    import nnsight
    import transformers
    from nnsight import NNsight

    hook_guards = _guard_hooks(args)
    workdir = Path(args.workdir)
    saved = load_file(str(workdir / "tensors.safetensors"))
    count = sum(name.startswith("ids_") for name in saved)
    tensors = {"delta": saved["delta"], "ids": [saved[f"ids_{i}"] for i in range(count)],
               "references": [saved[f"reference_{i}"] for i in range(count)]}
    delta, layer = tensors["delta"], args.layer
    load_start = time.perf_counter()

    def load() -> torch.nn.Module:
        model = transformers.AutoModelForCausalLM.from_pretrained(workdir / "model", dtype=torch.float32)
        return model.eval().requires_grad_(False)

    plain_model = load()
    hooked = _hooked_copy(plain_model, layer, delta)
    lm_eager = NNsight(load())
    compiled_model = load()
    lm_compiled = NNsight(compiled_model)
    compiled_model.compile()  # in place, torch's defaults (fullgraph=False); nnsight's controllers run inside it
    load_s = time.perf_counter() - load_start
    report: dict[str, Any] = {
        "side": "nnsight", "python": sys.executable, "nnsight": nnsight.__version__, "torch": torch.__version__,
        "transformers": transformers.__version__, "threads": torch.get_num_threads(), "load_s": round(load_s, 1),
        "dynamo_guards_on_hooks": hook_guards,
        "nnsight_compile": "NNsight(model) after model.compile() (torch.compile in place, fullgraph=False, "
                           "dynamic=None, inductor)", "nnsight_compile_note": NNSIGHT_COMPILE_NOTE, "shapes": {}}
    for ids, reference in zip(tensors["ids"], tensors["references"]):
        torch.compiler.reset()
        shape_report: dict[str, Any] = {}
        with torch.no_grad():
            plain = torch.compile(plain_model)
            variants: dict[str, Callable[[], Any]] = {
                "nnsight_eager": lambda: _nnsight_logits(lm_eager, ids, layer, delta),
                "nnsight_compiled": lambda: _nnsight_logits(lm_compiled, ids, layer, delta),
                "hook_eager": lambda: hooked(ids, use_cache=False).logits,
                "plain_compiled": lambda: plain(ids, use_cache=False).logits,
            }
            cold = {"plain_compiled": _cold(variants["plain_compiled"]),
                    "nnsight_compiled": _cold(variants["nnsight_compiled"])}
            diffs = {name: _max_diff(fn(), reference) for name, fn in variants.items() if name != "plain_compiled"}
            # after warm-up as well: a function past dynamo's recompile limit runs eagerly from then on
            diffs_again = {name: _max_diff(variants[name](), reference) for name in ("nnsight_compiled",)}
            medians = _round_robin(variants, args.runs, args.warmup)
        base = medians["plain_compiled"]
        shape_report["variants"] = {
            name: {"ms": round(medians[name] * 1e3, 2), "ratio_vs_plain_compiled": round(medians[name] / base, 4),
                   **({"max_abs_diff_vs_hook_eager": diffs[name]} if name in diffs else {}),
                   **cold.get(name, {})}
            for name in variants}
        shape_report["variants"]["nnsight_compiled"]["max_abs_diff_vs_hook_eager_after_warmup"] = \
            diffs_again["nnsight_compiled"]
        shape_report["note"] = ("hook_eager here is the gradpatch process's variant rerun in this process (same torch, "
                                "weights loaded from the saved folder); its diff is against that process's logits")
        report["shapes"]["x".join(map(str, ids.shape))] = shape_report
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="1x32,8x128")
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--layer", type=int, default=15)
    parser.add_argument("--random-weights", action="store_true")
    parser.add_argument("--peer-python", default=DEFAULT_PEER_PYTHON,
                        help="interpreter of the nnsight virtualenv (default: %(default)s)")
    parser.add_argument("--torch-default-hook-guards", action="store_true",
                        help="leave torch._dynamo.config.skip_nnmodule_hook_guards at torch's default (True): "
                             "hook_compiled then reuses plain_compiled's code and drops the hook")
    parser.add_argument("--no-nnsight", action="store_true", help="measure the gradpatch process's variants only")
    parser.add_argument("--side", default="gradpatch", choices=["gradpatch", "nnsight"], help=argparse.SUPPRESS)
    parser.add_argument("--workdir", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    report = nnsight_side(args) if args.side == "nnsight" else gradpatch_side(args)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
