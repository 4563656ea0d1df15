"""nnsight 0.8's side of benchmarks/engine/compile_peers.py, run in nnsight's virtualenv (it imports no gradpatch).

Reads ``--workdir`` as the gradpatch process wrote it (``model/``, a ``from_pretrained`` folder;
``tensors.safetensors``: the delta, the input ids and ``hook_eager`` logits of each shape) and measures, per shape,
nnsight's eager and compiled patched forward beside this process's own ``plain_compiled`` and ``hook_eager``. Prints
JSON.

Run (from the repository's root; compile_peers.py runs it): ``.peers/nnsight/bin/python -m
benchmarks.peers.nnsight.compile_side --workdir DIR [--shapes 1x32,8x128] [--runs 10] [--warmup 2] [--layer 15]``.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.engine.compile_probe import cold, guard_hooks, hooked_copy, max_diff, variant_rows  # before torch
from benchmarks.harness import header, round_robin

import torch  # noqa: E402,I001
from safetensors.torch import load_file  # noqa: E402

#: What nnsight says about torch.compile (checked against the sources named; reported in the JSON).
NNSIGHT_COMPILE_NOTE = (
    "nnsight 0.8.1 has no torch.compile option and never sets fullgraph; its one mention of torch.compile "
    "(nnsight/intervention/source.py, module_body) keeps a compiled forward as the body it runs. 'Forces "
    "fullgraph=False' is nnsight <= 0.7's LanguageModel._patch_generation_config (src/nnsight/modeling/language.py, "
    "for transformers' compiled generate); NNsight.md: 'Models cannot be used with torch.compile(fullgraph=True) "
    "because fullgraph compilation doesn't allow hooks.' A forward is compiled here as the model itself, in place.")


def _nnsight_logits(lm: Any, ids: torch.Tensor, layer: int, delta: torch.Tensor) -> torch.Tensor:
    """The logits of ``ids`` with ``delta`` added to layer ``layer``'s MLP ``down_proj`` output, through nnsight."""
    with lm.trace(ids, use_cache=False):
        down_proj = lm.model.layers[layer].mlp.down_proj
        down_proj.output = down_proj.output + delta
        logits = lm.output.logits.save()
    return logits


def nnsight_side(args: argparse.Namespace) -> dict[str, Any]:
    """The nnsight variants of each shape saved in ``args.workdir`` (module docstring)."""
    import nnsight
    import transformers
    from nnsight import NNsight

    hook_guards = guard_hooks(args.torch_default_hook_guards)
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
    hooked = hooked_copy(plain_model, layer, delta)
    lm_eager = NNsight(load())
    compiled_model = load()
    lm_compiled = NNsight(compiled_model)
    compiled_model.compile()  # in place, torch's defaults (fullgraph=False); nnsight's controllers run inside it
    load_s = time.perf_counter() - load_start
    report: dict[str, Any] = {
        "side": "nnsight", "header": header(), "nnsight": nnsight.__version__, "load_s": round(load_s, 1),
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
            colds = {name: cold(variants[name]) for name in ("plain_compiled", "nnsight_compiled")}
            diffs = {name: max_diff(fn(), reference) for name, fn in variants.items() if name != "plain_compiled"}
            variants["plain_compiled"]()  # compiled again outside cold()'s cache before timing, as the gradpatch side
            # after warm-up as well: a function past dynamo's recompile limit runs eagerly from then on
            diffs_again = {name: max_diff(variants[name](), reference) for name in ("nnsight_compiled",)}
            medians = round_robin(variants, args.runs, args.warmup)
        shape_report["variants"] = variant_rows(medians, diffs, colds)
        shape_report["variants"]["nnsight_compiled"]["max_abs_diff_vs_hook_eager_after_warmup"] = \
            diffs_again["nnsight_compiled"]
        shape_report["note"] = ("hook_eager here is the gradpatch process's variant rerun in this process (same torch, "
                                "weights loaded from the saved folder); its diff is against that process's logits")
        report["shapes"]["x".join(map(str, ids.shape))] = shape_report
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--shapes", default="1x32,8x128")
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--layer", type=int, default=15)
    parser.add_argument("--torch-default-hook-guards", action="store_true")
    print(json.dumps(nnsight_side(parser.parse_args()), indent=2))


if __name__ == "__main__":
    main()
