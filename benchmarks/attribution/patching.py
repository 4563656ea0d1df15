"""Gradient attribution against the exact activation-patching sweep on the embedded SmolLM2-135M; prints JSON.

For one task set (``benchmarks/data/<task>.jsonl``, built by ``benchmarks/data/build_attribution_tasks.py``), on the
first ``--n`` prompt pairs, at the positions from the first token where clean and corrupted prompts differ to the
end (every earlier position has the same activation in both runs, so its exact effect and every estimate are 0):

- per node kind (``resid``, ``heads``, ``mlp``; ``--kinds`` adds ``queries``, ``keys``): the exact sweep (noising, many
  variants per forward pass) and AtP, AtP-IG (m = ``--steps``), AtP* (QK fix) and AtP* with GradDrop; for each
  estimate the Pearson and Spearman correlations with the exact scores, the top-20 recall (the share of the 20
  largest |exact| units among the 20 largest |estimate| units), passes and seconds. GradDrop scores are magnitudes, so
  they are compared with |exact| (``*_abs`` figures, given for every method); ``verify_top20_units``: how many units
  one patches, in the order of |estimate|, before the 20 largest |exact| units are all verified; ``atp_star_verified``:
  AtP* with its ``--verify`` largest units then patched exactly (``verify_top``), against the exact sweep;
- ``sweep_speedup``: seconds per unit of one forward pass per patched unit (12 units sampled across the layers) over
  seconds per unit of each kind's batched sweep (variants along the batch dimension, the blocks before the first
  patched one run once, the variants patched at position p run tokens [p, end) on the base run's KV cache), in the
  same run; ``exact_warmup``: the seconds of a small first sweep that extracts the graphs of the cached calls;
- ``memory``: peak resident memory above the loaded model of AtP over every heads unit against one plain
  forward + backward (gradient to the embeddings), each in a fresh process;
- edges: EAP and EAP-IG (m = ``--steps``) faithfulness curves, and both against exact edge patching on a subset of
  edges (the ``--edges`` / 2 largest |EAP-IG| edges and as many random ones).

Run: ``OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.attribution.patching --task city_country [--n 3] [--rows 48]``
(one task per run; 21 minutes for city_country and 29 for ioi on a 2-core machine shared with other jobs;
``--skip edges,memory`` and ``--kinds`` split a run).
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

from benchmarks.harness import emit, peak_mib, reset_peak, run_module
from gradpatch import PatchableGraph
from gradpatch.attribution import (
    AttributionResult,
    PromptBatch,
    atp,
    atp_star,
    eap,
    edge_patching,
    exact_sweep,
    prompt_batch,
    resolve_nodes,
    verify_top,
)
from gradpatch.files.loaders import load_embedded_model

DATA = Path(__file__).resolve().parents[1] / "data"
KW = {"use_cache": False}


def pearson(x: torch.Tensor, y: torch.Tensor) -> float:
    """Pearson correlation of two score vectors (0 when one is constant)."""
    x, y = x.double() - x.double().mean(), y.double() - y.double().mean()
    denominator = float(x.norm() * y.norm())
    return float(x @ y) / denominator if denominator else 0.0


def spearman(x: torch.Tensor, y: torch.Tensor) -> float:
    """Spearman rank correlation (ties broken by order)."""
    return pearson(x.argsort().argsort().double(), y.argsort().argsort().double())


def recall(exact: torch.Tensor, estimate: torch.Tensor, k: int = 20) -> float:
    """Share of the ``k`` largest |exact| entries among the ``k`` largest |estimate| entries."""
    k = min(k, len(exact))
    top = set(exact.abs().topk(k).indices.tolist())
    return len(top & set(estimate.abs().topk(k).indices.tolist())) / k


def verification_cost(exact: torch.Tensor, estimate: torch.Tensor, k: int = 20) -> int:
    """Units to patch, in the order of |estimate|, until the ``k`` largest |exact| units are all among them (a prefilter
    followed by verification, as Kramár et al. 2024 compare methods: recall of the true top nodes against this cost)."""
    order = estimate.abs().argsort(descending=True).tolist()
    rank = {unit: place for place, unit in enumerate(order, start=1)}
    return max(rank[unit] for unit in exact.abs().topk(min(k, len(exact))).indices.tolist())


def compare(exact: torch.Tensor, estimate: torch.Tensor) -> dict[str, float]:
    """Signed and magnitude agreement of an estimate with the exact scores."""
    return {"pearson": round(pearson(exact, estimate), 4), "spearman": round(spearman(exact, estimate), 4),
            "top20_recall": recall(exact, estimate), "verify_top20_units": verification_cost(exact, estimate),
            "pearson_abs": round(pearson(exact.abs(), estimate.abs()), 4),
            "spearman_abs": round(spearman(exact.abs(), estimate.abs()), 4)}


def scores(result: AttributionResult) -> torch.Tensor:
    return torch.tensor([s.score for s in result.scores])


def first_difference(batch: PromptBatch) -> int:
    """The first position where any clean prompt differs from its corrupted one."""
    differs = (batch.clean != batch.corrupted).any(0)
    return int(differs.nonzero()[0])


def node_kind(pg: PatchableGraph, batch: PromptBatch, kind: str, positions: list[int], rows: int,
              steps: int, verify: int) -> dict[str, Any]:
    """Exact sweep and the four estimates for one node kind (AtP-IG with ``steps`` interpolation steps), and AtP*
    with its ``verify`` top units then patched exactly (``atp_star_verified``)."""
    exact = exact_sweep(pg, batch, kind, positions=positions, batch_size=rows, forward_kwargs=KW)
    reference = scores(exact)
    out: dict[str, Any] = {"units": len(reference), "metric": {"clean": round(exact.metric_clean, 4),
                                                                "corrupted": round(exact.metric_corrupted, 4)},
                           "exact": {"seconds": round(exact.seconds, 2),
                                     "passes": {"forward": exact.forward, "backward": 0},
                                     "forward_tokens": exact.forward_tokens}}
    runs: dict[str, Callable[[], AttributionResult]] = {
        "atp": lambda: atp(pg, batch, kind, positions=positions, forward_kwargs=KW),
        "atp_ig": lambda: atp(pg, batch, kind, positions=positions, steps=steps, forward_kwargs=KW),
        "atp_star": lambda: atp_star(pg, batch, kind, positions=positions, forward_kwargs=KW),
        "atp_star_graddrop": lambda: atp_star(pg, batch, kind, positions=positions, grad_drop=True,
                                              forward_kwargs=KW),
        "atp_star_verified": lambda: verify_top(pg, batch, atp_star(pg, batch, kind, positions=positions,
                                                                    forward_kwargs=KW),
                                                verify, batch_size=rows, forward_kwargs=KW),
    }
    top = reference.abs().topk(min(5, len(reference))).indices.tolist()
    largest = [{"node": exact.scores[i].node, "position": exact.scores[i].position, "head": exact.scores[i].head,
                "exact": round(exact.scores[i].score, 4)} for i in top]
    for name, run in runs.items():
        result = run()
        estimate = scores(result)
        out[name] = {**compare(reference, estimate), "seconds": round(result.seconds, 2),
                     "passes": {"forward": result.forward, "backward": result.backward}}
        if result.method.endswith("+verify"):  # its top units are measured: a prefilter's cost says nothing of it
            del out[name]["verify_top20_units"]
        for entry, i in zip(largest, top):
            entry[name] = round(float(estimate[i]), 4)
    out["largest_exact"] = largest
    return out


def warmup(pg: PatchableGraph, batch: PromptBatch, positions: list[int]) -> dict[str, Any]:
    """One exact sweep of the last block's MLP output before the timed ones: the first sweep on a graph extracts the
    graphs of the cached calls (a KV cache and a 4-D mask, each class of sizes), once per graph; its seconds are that
    one-time cost, kept out of the kinds' timings (as building the PatchableGraph is)."""
    last = resolve_nodes(pg, "mlp")[-1:]
    result = exact_sweep(pg, batch, last, positions=positions, batch_size=batch.size, forward_kwargs=KW)
    return {"seconds": round(result.seconds, 2), "units": len(result.scores), "passes": result.forward}


def sweep_speedup(pg: PatchableGraph, batch: PromptBatch, positions: list[int],
                  nodes_report: dict[str, Any]) -> dict[str, Any]:
    """Seconds per unit of one forward pass per patched unit (every variant's whole forward, ``batch_size`` = the
    prompts), on 12 MLP units of 12 layers at the last position, against each kind's batched sweep."""
    nodes = [n for n in resolve_nodes(pg, "mlp") if n.layer is not None and n.layer % 5 < 2][:12]
    single = exact_sweep(pg, batch, nodes, positions=positions[-1:], batch_size=batch.size, forward_kwargs=KW,
                         share_prefix=False)
    per_unit = single.seconds / len(single.scores)
    out: dict[str, Any] = {"one_forward_per_unit_s_per_unit": round(per_unit, 4), "sampled_units": len(single.scores)}
    for kind, report in nodes_report.items():
        batched = report["exact"]["seconds"] / report["units"]
        out[kind] = {"batched_s_per_unit": round(batched, 4), "speedup": round(per_unit / batched, 2)}
    return out


def edges(pg: PatchableGraph, batch: PromptBatch, steps: int, subset: int, rows: int) -> dict[str, Any]:
    """EAP and EAP-IG faithfulness curves and their agreement with exact edge patching on a subset of edges."""
    results = {"eap": eap(pg, batch, batch_size=rows, forward_kwargs=KW),
               "eap_ig": eap(pg, batch, steps=steps, batch_size=rows, forward_kwargs=KW)}
    ranked = results["eap_ig"].edges
    rng = random.Random(0)
    chosen = ranked[:subset // 2] + rng.sample(ranked[subset // 2:], subset - subset // 2)
    pairs = [(e.upstream, e.downstream) for e in chosen]
    start = time.perf_counter()
    exact = torch.tensor([e.score for e in edge_patching(pg, batch, pairs, batch_size=rows, forward_kwargs=KW)])
    out: dict[str, Any] = {"edges": len(ranked), "exact_subset": {"edges": len(pairs),
                                                                  "seconds": round(time.perf_counter() - start, 2)}}
    for name, result in results.items():
        lookup = {(e.upstream, e.downstream): e.score for e in result.edges}
        estimate = torch.tensor([lookup[pair] for pair in pairs])
        five = next((f for k, f in result.faithfulness if k >= 0.05 * len(ranked)), None)
        out[name] = {**compare(exact, estimate), "seconds": round(result.seconds, 2),
                     "passes": {"forward": result.forward, "backward": result.backward},
                     "faithfulness": [[k, round(f, 4)] for k, f in result.faithfulness],
                     "faithfulness_at_5pct": None if five is None else round(five, 4)}
    return out


def memory_child(task: str, n: int, what: str) -> None:
    """In a fresh process: peak resident memory above the loaded model and graph, of ``what`` (``atp`` or
    ``fwd_bwd``); prints one JSON line."""
    model, tokenizer = load_embedded_model()
    batch = load_batch(tokenizer, task, n)
    pg = PatchableGraph(model, batch.clean[:1].expand(2, -1), use_cache=False)
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    reset_peak()
    before = peak_mib()
    if what == "atp":
        atp(pg, batch, "heads", forward_kwargs=KW)
    else:
        embeddings = model.get_input_embeddings()(batch.clean).detach().requires_grad_(True)
        logits = model(inputs_embeds=embeddings, use_cache=False).logits[:, -1]
        rows = torch.arange(batch.size)
        (logits[rows, batch.answer] - logits[rows, batch.foil]).mean().backward()
    print(json.dumps({"peak_mb_above_model": round(peak_mib() - before, 1)}))


def memory(task: str, n: int) -> dict[str, Any]:
    """AtP's peak memory against one forward + backward, each measured in a fresh process."""
    out = {}
    for what in ("fwd_bwd", "atp"):
        done = run_module(sys.executable, "benchmarks.attribution.patching",
                          ["--task", task, "--n", str(n), "--memory-child", what])
        out[what] = json.loads(done.stdout.strip().splitlines()[-1])["peak_mb_above_model"]
    out["ratio"] = round(out["atp"] / max(out["fwd_bwd"], 1e-9), 2)
    return out


def load_batch(tokenizer: Any, task: str, n: int) -> PromptBatch:
    lines = (DATA / f"{task}.jsonl").read_text(encoding="utf-8").splitlines()
    return prompt_batch(tokenizer, [json.loads(line) for line in lines[:n]])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", default="city_country", help="a task file in benchmarks/data (without .jsonl)")
    parser.add_argument("--n", type=int, default=3, help="prompt pairs (default %(default)s)")
    parser.add_argument("--rows", type=int, default=48, help="rows per forward pass (default %(default)s)")
    parser.add_argument("--kinds", default="resid,heads,mlp", help="node kinds (default %(default)s)")
    parser.add_argument("--steps", type=int, default=5, help="AtP-IG and EAP-IG steps (default %(default)s)")
    parser.add_argument("--verify", type=int, default=40, help="AtP* units verified exactly (default %(default)s)")
    parser.add_argument("--edges", type=int, default=64, help="edges patched exactly (default %(default)s)")
    parser.add_argument("--skip", default="", help="comma-separated parts to skip: nodes,speed,edges,memory")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu; the memory part is CPU-only)")
    parser.add_argument("--memory-child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.memory_child:
        memory_child(args.task, args.n, args.memory_child)
        return 0
    skip = set(filter(None, args.skip.split(",")))
    start = time.perf_counter()
    model, tokenizer = load_embedded_model(device=args.device)
    batch = load_batch(tokenizer, args.task, args.n).to(args.device)
    pg = PatchableGraph(model, batch.clean[:1].expand(2, -1), use_cache=False)
    positions = list(range(first_difference(batch), batch.length))
    report: dict[str, Any] = {
        "task": args.task, "prompts": batch.size, "tokens": batch.length, "positions": positions,
        "machine": {"torch": torch.__version__, "threads": torch.get_num_threads(), "cpu": platform.processor(),
                    "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else None},
    }
    if "nodes" not in skip:
        report["exact_warmup"] = warmup(pg, batch, positions)
        report["verify"] = args.verify
        report["nodes"] = {kind: node_kind(pg, batch, kind, positions, args.rows, args.steps, args.verify)
                           for kind in args.kinds.split(",")}
    if "speed" not in skip and "nodes" in report:
        report["sweep_speedup"] = sweep_speedup(pg, batch, positions, report["nodes"])
    if "edges" not in skip:
        report["edges"] = edges(pg, batch, args.steps, args.edges, args.rows)
    if "memory" not in skip:
        report["memory"] = memory(args.task, args.n)
    report["seconds"] = round(time.perf_counter() - start, 1)
    emit(report, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
