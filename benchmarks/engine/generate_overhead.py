"""Generation overhead: ``pg.generate`` with a patch active against ``model.generate``, both with the KV cache;
prints JSON.

For SmolLM2-135M-Instruct (the embedded GGUF weights on CPU in float32; its config with random weights with
``--random-weights``, another ``--dtype``, ``--device cuda``, or without the GGUF), a prompt of ``--prompt`` tokens
and ``--new`` new tokens (greedy, every row generating all of them), it times, round-robin after a warm-up:

- ``plain``: ``model.generate(ids, max_new_tokens=N, do_sample=False)`` (transformers' DynamicCache);
- ``graph``: ``pg.generate(...)`` with no patch;
- ``patched``: ``pg.generate(...)`` inside ``pg.patch({"model.layers_<mid>.output": AddPatch(value=zeros)})``;
- ``recompute`` (with ``--recompute``): ``pg.generate(..., use_cache=False)``, the previous behaviour.

Ratios are medians over the plain median, from this run; ``same_tokens`` checks that the graph generates the
plain model's tokens. Target: ``patched_ratio`` ≤ 1.05.

Run: ``.venv/bin/python -m benchmarks.engine.generate_overhead [--prompt 384] [--new 64] [--rounds 3] [--device cuda]``.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from typing import Any, Callable

import torch

from benchmarks.harness import emit
from gradpatch import AddPatch, PatchableGraph
from gradpatch.files.loaders import WEIGHT_DTYPES as DTYPES, embedded_or_random_model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    parser.add_argument("--prompt", type=int, default=384, help="prompt tokens (default 384)")
    parser.add_argument("--new", type=int, default=64, help="new tokens (default 64)")
    parser.add_argument("--batch", type=int, default=1, help="rows (default 1)")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds (default 3)")
    parser.add_argument("--recompute", action="store_true", help="also time use_cache=False")
    parser.add_argument("--random-weights", action="store_true", help="SmolLM2's config with random weights")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default 2; 1 on a busy machine)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, source = embedded_or_random_model(DTYPES[args.dtype], args.device, args.random_weights)
    vocab = model.config.vocab_size
    ids = torch.randint(3, vocab, (args.batch, args.prompt), generator=torch.Generator().manual_seed(0))
    ids = ids.to(args.device)
    t0 = time.perf_counter()
    pg = PatchableGraph(model, ids[:, :8], use_cache=False)
    construction = time.perf_counter() - t0
    node = f"model.layers_{len(model.model.layers) // 2}.output"
    zeros = torch.zeros(model.config.hidden_size, device=args.device, dtype=DTYPES[args.dtype])
    settings = {"max_new_tokens": args.new, "min_new_tokens": args.new, "do_sample": False,
                "pad_token_id": model.config.pad_token_id}
    synchronize = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)

    def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
        synchronize()
        start = time.perf_counter()
        with torch.no_grad():
            out = fn()
        synchronize()
        return time.perf_counter() - start, out

    def patched() -> Any:
        with pg.patch({node: AddPatch(value=zeros)}):
            return pg.generate(ids, **settings)

    variants: dict[str, Callable[[], Any]] = {
        "plain": lambda: model.generate(ids, **settings),
        "graph": lambda: pg.generate(ids, **settings),
        "patched": patched,
    }
    if args.recompute:
        variants["recompute"] = lambda: pg.generate(ids, use_cache=False, **settings)
    warm = {name: timed(fn) for name, fn in variants.items()}  # first graph calls extract prefill/decode graphs
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, fn in variants.items():
            times[name].append(timed(fn)[0])
    median = {name: statistics.median(values) for name, values in times.items()}
    outputs = {name: output for name, (_, output) in warm.items()}
    report = {
        "torch": torch.__version__, "python": platform.python_version(), "threads": torch.get_num_threads(),
        "device": args.device, "dtype": args.dtype, "model": f"SmolLM2-135M ({source})",
        "prompt_tokens": args.prompt, "new_tokens": args.new, "batch": args.batch, "rounds": args.rounds,
        "patched_node": node, "construction_s": round(construction, 3),
        "first_graph_generate_s": round(warm["graph"][0], 3),
        **{f"{name}_s": round(value, 4) for name, value in median.items()},
        **{f"{name}_ratio": round(median[name] / median["plain"], 4) for name in variants if name != "plain"},
        "same_tokens": all(torch.equal(outputs[name], outputs["plain"]) for name in outputs),
    }
    emit(report, device=args.device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
