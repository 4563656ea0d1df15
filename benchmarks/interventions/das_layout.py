"""Seconds per DAS training step in the two interchange layouts, on the embedded SmolLM2-135M-Instruct; prints JSON.

The same records, node and subspace size as ``benchmarks/interventions/das_country.py``: one ``InterventionModule``
per layout (``shared_batch=True``: base and source rows in one forward pass; ``False``: a source pass without
gradients that stops at the patched node, then the base pass), their steps alternating in one process so that both see
the same load. ``ratio_shared_over_split`` is the mean seconds of the shared batch over the two passes', the first
step of each layout left out (warm-up). It is what ``InterventionModule(shared_batch=None)`` chooses by.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.interventions.das_layout [--layer 10] [--dim 16] [--batch-size
16] [--steps 4] [--threads 1] [--device cuda]``.
"""

from __future__ import annotations

import argparse
import platform
import time
from pathlib import Path

import torch

from benchmarks.harness import emit
from gradpatch.files.loaders import load_embedded_model
from recipes.interchange.counterfactual import read_counterfactuals
from recipes.interchange.module import InterventionModule

DATA = Path(__file__).resolve().parents[1] / "data"


def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layer", type=int, default=10)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=4, help="steps per layout, the first one a warm-up (>= 2)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error("--steps must be at least 2 (the first step of each layout is a warm-up)")
    torch.set_num_threads(args.threads)
    model, tokenizer = load_embedded_model(device=args.device)
    model.eval()
    records = read_counterfactuals(DATA / "das_country_train.jsonl")
    modules = {}
    for shared in (True, False):
        torch.manual_seed(0)
        modules[shared] = InterventionModule.from_model(model, tokenizer, shared_batch=shared, interventions=[
            {"node": f"model.layers_{args.layer}.output", "kind": "rotated", "dim": args.dim}]).to(args.device)
    optimizers = {shared: torch.optim.Adam(m.trainable_parameters(), lr=0.01) for shared, m in modules.items()}
    seconds: dict[bool, list[float]] = {True: [], False: []}
    for step in range(args.steps):
        chosen = records[step * args.batch_size:(step + 1) * args.batch_size]
        for shared, module in modules.items():
            start = time.perf_counter()
            encoded = module.encode(chosen)
            log_probs = module.interchange_log_probs(encoded)
            loss = torch.nn.functional.nll_loss(log_probs, encoded.labels.to(log_probs.device))
            optimizers[shared].zero_grad()
            loss.backward()
            optimizers[shared].step()
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            seconds[shared].append(time.perf_counter() - start)
    result = {"benchmark": "das_layout", "layer": args.layer, "dim": args.dim, "batch_size": args.batch_size,
              "shared_s": [round(s, 3) for s in seconds[True]], "split_s": [round(s, 3) for s in seconds[False]],
              "ratio_shared_over_split": round(sum(seconds[True][1:]) / sum(seconds[False][1:]), 3),
              "threads": args.threads, "device": args.device, "torch": torch.__version__,
              "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else None,
              "machine": platform.processor() or platform.machine()}
    emit(result, device=args.device)
    return result


if __name__ == "__main__":
    main()
