"""Documents per second of the second-moment statistics job (recipes.editing.stats_job) on 1 and 2 processes; JSON.

Each configuration runs in a fresh subprocess (``--worker``): ``Trainer(strategy="ddp", devices=K)`` on the CPU with
the gloo backend (or the GPU with NCCL: ``--accelerator gpu --devices 1 2 4 8``), each process limited to
``--threads`` threads (default 1, so K processes use K cores). After an untimed warm-up batch (graph extraction),
rank 0 times the pass from ``on_predict_start`` (model loaded and moved, ranks agreed) until ``Trainer.predict``
returns (the final all-reduce and the cache files included); every rank reports its CPU time and peak resident
memory. Configurations are run in turn ``--repeats`` times (interleaved, so load from other processes on a shared
machine hits each alike) and the best time is kept.

Reported per K: ``docs_per_s`` (documents / best seconds), ``speedup`` (over K=1), ``efficiency`` (speedup / K),
``docs_per_cpu_s`` (documents / CPU seconds of all ranks: the work the split adds, which other processes' load
disturbs less than wall time), ``max_rel_diff_vs_1`` (largest ``|C_K − C_1| / max|C_1|`` over the nodes: the
distributed result beside the one-process one) and ``peak_rss_mib`` per rank; plus ``reference_docs_per_s``, the
editors' own one-process ``compute_second_moments`` on the same documents in a K=1 worker (also per CPU second), and
its difference from the job's result.

Run: ``.venv/bin/python -m benchmarks.editing.distributed_stats [--tiny] [--docs N] [--devices 1 2] [--repeats R]``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.harness import ROOT, emit




def _load(tiny: bool, device: str) -> tuple[Any, Any, list[str]]:
    """``(graph, tokenizer, nodes)``: the embedded SmolLM2-135M at MEMIT's layers 2-6, or the tiny Llama."""
    from editors import DEFAULT_SMOLLM2_NODES, editable_graph
    from gradpatch.files.loaders import load_embedded_model
    from recipes.testing import tiny_backbone

    if tiny:
        model, tokenizer = tiny_backbone(layers=2)
        nodes = ["model.layers_0.mlp.down_proj", "model.layers_1.mlp.down_proj"]
    else:
        model, tokenizer = load_embedded_model(device=device)
        nodes = list(DEFAULT_SMOLLM2_NODES)
    return editable_graph(model.to(device), tokenizer), tokenizer, nodes


def _corpus(tiny: bool) -> Any:
    from editors import Corpus, wiki_summaries
    from recipes.testing import WORDS

    if not tiny:
        return wiki_summaries()
    import random

    rng = random.Random(0)
    return Corpus(name="tiny-words", texts=[" ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 120)))
                                            for _ in range(4096)])


def worker(args: argparse.Namespace) -> None:
    """One configuration: run the job on ``args.devices`` processes and write each rank's figures to JSON."""
    from lightning.pytorch import Callback

    from editors import compute_second_moments, resolve_layer
    from recipes import SecondMomentJob, run_statistics_job

    torch.set_num_threads(args.threads)
    devices = int(args.devices[0])
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = f"cuda:{rank}" if args.accelerator == "gpu" else "cpu"
    pg, tokenizer, nodes = _load(args.tiny, device)
    job = SecondMomentJob(pg, tokenizer, nodes, _corpus(args.tiny), n_samples=args.docs,
                          max_length=args.max_length, batch_size=args.batch_size, cache_dir=args.cache_dir,
                          checkpoint_every=10**9, restart=True)

    layers = [resolve_layer(pg, n) for n in nodes]
    # Untimed warm-up: the graph is extracted once per class of input sizes, on the first batches of either path.
    compute_second_moments(pg, tokenizer, layers, _corpus(args.tiny), n_samples=args.batch_size,
                           max_length=args.max_length, batch_size=args.batch_size, progress=False)

    class Clock(Callback):
        def on_predict_start(self, trainer: Any, pl_module: Any) -> None:
            if args.accelerator == "gpu":
                torch.cuda.synchronize()
            self.start, self.cpu_start = time.perf_counter(), time.process_time()

    clock = Clock()
    moments = run_statistics_job(job, accelerator=args.accelerator, devices=devices,
                                 strategy="ddp" if devices > 1 else "auto", callbacks=[clock],
                                 enable_progress_bar=False)
    seconds, cpu_seconds = time.perf_counter() - clock.start, time.process_time() - clock.cpu_start
    record: dict[str, Any] = {"rank": job.trainer.global_rank, "world_size": job.trainer.world_size,
                              "seconds": seconds, "cpu_seconds": cpu_seconds, "n_documents": moments[0].n_samples,
                              "n_tokens": moments[0].n_tokens,
                              "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    if args.reference and devices == 1:
        t0, cpu0 = time.perf_counter(), time.process_time()
        matrices, _, _ = compute_second_moments(pg, tokenizer, layers,
                                                _corpus(args.tiny), n_samples=args.docs,
                                                max_length=args.max_length, batch_size=args.batch_size,
                                                progress=False)
        record["reference_seconds"] = time.perf_counter() - t0
        record["reference_cpu_seconds"] = time.process_time() - cpu0
        record["reference_max_rel_diff"] = max(
            float((m.matrix - r.cpu()).abs().max() / r.abs().max()) for m, r in zip(moments, matrices))
    torch.save([m.matrix for m in moments], f"{args.out}.rank{record['rank']}.pt")
    Path(f"{args.out}.rank{record['rank']}.json").write_text(json.dumps(record))


def _launch(args: argparse.Namespace, devices: int, out: Path, reference: bool) -> list[dict[str, Any]]:
    command = [sys.executable, "-m", "benchmarks.editing.distributed_stats", "--worker", "--devices", str(devices),
               "--docs", str(args.docs), "--max-length", str(args.max_length), "--batch-size", str(args.batch_size),
               "--threads", str(args.threads), "--accelerator", args.accelerator, "--out", str(out),
               "--cache-dir", str(out.parent / f"cache-{out.name}")] + (["--tiny"] if args.tiny else []) + (
               ["--reference"] if reference else [])
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads),
           "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"worker with {devices} processes failed:\n{done.stderr[-3000:]}")
    return [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(devices)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny random Llama and a word corpus (smoke run)")
    parser.add_argument("--docs", type=int, default=256)
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--devices", nargs="+", default=["1", "2"], help="process counts to compare")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--accelerator", default="cpu", choices=("cpu", "gpu"))
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--reference", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--cache-dir", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    counts = [int(d) for d in args.devices]
    runs: dict[int, list[list[dict[str, Any]]]] = {k: [] for k in counts}
    with tempfile.TemporaryDirectory() as folder:
        for repeat in range(args.repeats):
            for k in counts:
                runs[k].append(_launch(args, k, Path(folder) / f"k{k}-r{repeat}", reference=(k == 1 and repeat == 0)))
        base = torch.load(Path(folder) / f"k{counts[0]}-r0.rank0.pt")
        results = {}
        for k in counts:
            best = min(runs[k], key=lambda ranks: ranks[0]["seconds"])
            matrices = torch.load(Path(folder) / f"k{k}-r0.rank0.pt")
            results[k] = {
                "docs_per_s": best[0]["n_documents"] / best[0]["seconds"],
                "seconds": [ranks[0]["seconds"] for ranks in runs[k]],
                "n_documents": best[0]["n_documents"], "n_tokens": best[0]["n_tokens"],
                "cpu_seconds_per_rank": [r["cpu_seconds"] for r in best],
                "docs_per_cpu_s": best[0]["n_documents"] / sum(r["cpu_seconds"] for r in best),
                "peak_rss_mib": [r["peak_rss_mib"] for r in best],
                "max_rel_diff_vs_1": max(float((m - b).abs().max() / b.abs().max()) for m, b in zip(matrices, base)),
            }
    first = results[counts[0]]
    for k in counts:
        results[k]["speedup"] = results[k]["docs_per_s"] / first["docs_per_s"]
        results[k]["efficiency"] = results[k]["speedup"] / (k / counts[0])
    reference = runs[counts[0]][0][0]
    emit({
        "benchmark": "distributed_stats", "model": "tiny-llama" if args.tiny else "SmolLM2-135M-Instruct",
        "accelerator": args.accelerator, "threads_per_process": args.threads, "docs": args.docs,
        "max_length": args.max_length, "batch_size": args.batch_size, "repeats": args.repeats,
        "cpu": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
        "load_average_1_5_15_min_at_end": os.getloadavg(),
        "torch": torch.__version__,
        "reference_docs_per_s": reference["n_documents"] / reference["reference_seconds"],
        "reference_docs_per_cpu_s": reference["n_documents"] / reference["reference_cpu_seconds"],
        "reference_max_rel_diff": reference["reference_max_rel_diff"],
        "processes": {str(k): v for k, v in results.items()},
    }, device=args.device)


if __name__ == "__main__":
    main()
