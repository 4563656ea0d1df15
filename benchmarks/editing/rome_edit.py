"""Cost of one ROME edit with cached statistics, against plain forward+backward passes; prints JSON.

Measured in one run, on the same machine state:

- ``edit_s``: ``ROME.compute(request)`` with the second moment and the context prefixes already cached (the
  usual case: they are computed once per layer and reused by every edit) — key, value optimisation and update;
  the value optimisation runs under ``Trainer.fit`` as in the recipes (``--runner lightning``, the default) or in
  the editors' plain-torch loop (``--runner plain``);
- ``plain_fwd_bwd_s``: the median time of one plain forward + backward pass of the original model (no
  PatchableGraph) on the same batch as one optimisation step (the value-optimisation prompts), with the same
  loss and the gradient flowing only to a delta added at the same layer output (a PyTorch forward hook), i.e.
  exactly the work an optimisation step needs, without the patch engine; measured before and after the edit;
- ``ratio = edit_s / (steps × plain_fwd_bwd_s)`` where ``steps`` counts the optimiser steps actually taken
  (early stopping included); the target is ``ratio <= 1.5``. ``ratio_per_evaluation`` divides by the number of
  loss evaluations instead (one more than ``steps`` when the optimisation stopped early).

Run: ``.venv/bin/python -m benchmarks.editing.rome_edit [--model PATH --node NODEPATH] [--tiny] [--reps N] [--runner
R]``. Without ``--model`` it edits the embedded SmolLM2-135M at the default layer; the first run computes the layer
statistics (under a minute on 2 idle CPU cores) and caches them. ``--tiny`` uses a random tiny Llama (seconds).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from typing import Any

import torch

from benchmarks.harness import emit
from gradpatch import PatchableGraph

from editors import ROME, EditRequest, ROMEConfig, ValueObjective, compute_key, optimize_value
from editors.statistics.corpus import Corpus
from gradpatch.model_io import wrapped_model
from editors.rome import DEFAULT_SMOLLM2_NODE
from gradpatch.testing import TOY_SENTENCES, byte_level_tokenizer, tiny_llama
from editors.value.search import frozen_parameters
from recipes.editing.rome_value import LightningValueRunner

REQUEST = EditRequest(prompt="The {} is located in the city of", subject="Eiffel Tower", target_new="Rome",
                      target_true="Paris")


def plain_step_seconds(model: torch.nn.Module, objective: ValueObjective, reps: int) -> list[float]:
    """Times of plain forward+backward passes on the objective's batch (delta via a forward hook, same loss)."""
    layer = objective.layer
    rows, cols = objective.patch_index
    delta = torch.nn.Parameter(torch.zeros(layer.d_out, device=layer.weight.device))

    def hook(_module: Any, _inputs: Any, output: torch.Tensor) -> torch.Tensor:
        output = output.clone()
        output[rows, cols] = output[rows, cols] + delta
        return output

    times = []
    reference: torch.Tensor | None = None
    with frozen_parameters(model):
        handle = layer.module.register_forward_hook(hook)
        try:
            for _ in range(reps + 1):  # the first pass warms up
                t0 = time.perf_counter()
                logits = model(objective.input_ids, use_cache=False).logits
                log_probs = torch.log_softmax(logits.float(), dim=-1)
                loss = -log_probs[objective.target_rows, objective.target_cols, objective.target_tokens].mean()
                kl_lp = log_probs[objective.kl_rows, objective.kl_cols]
                if reference is None:
                    reference = kl_lp.detach()
                kl = torch.nn.functional.kl_div(reference, kl_lp, log_target=True, reduction="batchmean")
                loss = loss + 0.0625 * kl
                loss.backward()
                times.append(time.perf_counter() - t0)
                delta.grad = None
        finally:
            handle.remove()
    return times[1:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model directory or .gguf (default: embedded SmolLM2-135M)")
    parser.add_argument("--node", default=None, help=f"edited layer (default {DEFAULT_SMOLLM2_NODE})")
    parser.add_argument("--tiny", action="store_true", help="a random tiny Llama instead of a real model")
    parser.add_argument("--reps", type=int, default=5, help="plain passes measured before and after the edit")
    parser.add_argument("--n-samples", type=int, default=None, help="corpus documents for the statistics")
    parser.add_argument("--cache-dir", default=None, help="statistics cache folder")
    parser.add_argument("--runner", choices=("plain", "lightning"), default="lightning",
                        help="value runner: the editors' plain-torch loop or the recipes' Trainer.fit "
                             "(default %(default)s)")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    config = ROMEConfig(progress=True, cache_dir=args.cache_dir)
    corpus = None
    if args.tiny:
        tokenizer = byte_level_tokenizer()
        model = tiny_llama(len(tokenizer))
        node = args.node or "model.layers_0.mlp.down_proj"
        corpus = Corpus(name="toy", texts=list(TOY_SENTENCES) * 8)
        config.n_samples = 64
        config.clamp_factor = 500.0
    else:
        from gradpatch.files.loaders import load_model

        model, tokenizer = load_model(args.model)
        node = args.node or DEFAULT_SMOLLM2_NODE
    if args.n_samples is not None:
        config.n_samples = args.n_samples
    example = torch.randint(0, len(tokenizer), (2, 8))
    pg = PatchableGraph(model, example, use_cache=False).eval()
    runner = optimize_value if args.runner == "plain" else LightningValueRunner()
    rome = ROME(pg, tokenizer, node, config=config, corpus=corpus, value_runner=runner)
    t0 = time.perf_counter()
    stats = rome.statistics()
    templates = rome.templates()
    cached_s = time.perf_counter() - t0

    # The batch of one optimisation step, for the plain baseline.
    layer = rome.layer
    key = compute_key(pg, tokenizer, layer, REQUEST.prompt, REQUEST.subject, templates)
    objective = ValueObjective(pg, tokenizer, layer, REQUEST, templates.subset(config.value_prefixes),
                               layer.forward_value(key).detach())
    plain = wrapped_model(pg)
    before = plain_step_seconds(plain, objective, args.reps)
    t0 = time.perf_counter()
    edit = rome.compute(REQUEST)
    edit_s = time.perf_counter() - t0
    after = plain_step_seconds(plain, objective, args.reps)
    step_s = statistics.median(before + after)
    steps = int(edit.info["steps"])
    evaluations = len(rome.last_value.history) if rome.last_value is not None else steps
    ratio = edit_s / (max(steps, 1) * step_s)
    result = {
        "benchmark": "rome_edit",
        "model": "tiny-llama" if args.tiny else (args.model or "embedded:SmolLM2-135M-Instruct"),
        "node": node,
        "runner": args.runner,
        "batch_shape": list(objective.input_ids.shape),
        "statistics_and_templates_load_s": cached_s,
        "statistics": {"n_tokens": stats.n_tokens, "n_samples": stats.n_samples, "corpus": stats.corpus},
        "edit_s": edit_s,
        "edit_timings_s": edit.info["timings_s"],
        "steps": steps,
        "evaluations": evaluations,
        "plain_fwd_bwd_s": step_s,
        "plain_fwd_bwd_s_all": before + after,
        "ratio": ratio,
        "ratio_per_evaluation": edit_s / (max(evaluations, 1) * step_s),
        "target_ratio": 1.5,
        "ok": ratio <= 1.5,
        "final_target_prob": edit.info.get("target_prob"),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "machine": platform.machine(),
    }
    emit(result, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
