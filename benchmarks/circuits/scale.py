"""Attribution graphs (gradpatch.circuits): size, time, memory and exactness on one prompt; prints JSON.

Models: ``smollm2`` (the embedded SmolLM2-135M, 30 layers; with ``--random-weights`` a model of its shape with
random weights, which needs no GGUF: hidden 576, MLP 1536, 9 heads, 3 KV heads, vocabulary 49,152, tied embeddings,
and random token ids), with TopK skip transcoders of random weights (``--latents`` latents, k = ``--k``) at the
first ``--layers`` MLPs (default: all); or the test suite's ``tiny-llama`` / ``tiny-gpt2`` (ReLU skip transcoders,
64 latents, at both MLPs, as tests/circuits/test_circuits.py builds them). For each: the frozen nodes found, whether the
replay is the model bit for bit, the graph's size, the seconds of :func:`~gradpatch.circuits.attribute` and the
targets per backward pass it used (``--batch-size``, made smaller by ``--max-memory`` GiB; the graphs for batches of
2 or more rows are extracted before, untimed), its wall-clock and process CPU seconds (all threads; the CPU is
shared), its peak memory (CPU: the resident memory sampled every 20 ms during the call, and its rise over the
resident memory before the call; CUDA: the peak of allocated GPU memory above what was allocated before), the
exactness of the linearisation over every feature node, err = |h − Σ_s A[h,s] − bias(h)| as a fraction of Σ_s
|A[h,s]| + |bias(h)| (worst) and of |h| (median; share ≤ 1e-4), the replacement and completeness scores and the
pruned graph's size (circuit-tracer's default thresholds; ``--no-prune`` leaves them out). ``--sweep N`` times N
forward passes of the model (batch 1, no gradients) each with one active feature ablated (−a W_dec[f] added to its
MLP output at its position, which is the spliced model with that latent zeroed), and extrapolates to one exact
patching sweep over every active feature. Position 0 follows circuit-tracer (``attribute``'s
``zero_first_position``: no feature node there, its contribution in the biases); ``--keep-first-position`` keeps
position 0's features and errors as nodes. ``--max-feature-nodes N`` (default 7,500, ``attribute``'s; 0: every
feature) computes the rows of N features chosen by influence (circuit-tracer's rounds), and the report gives the
graph's rows held against what a dense ``[n, n]`` adjacency would take.

``--curve 64,128,256,512,1024`` runs the script once per prompt length, each in its own process (so that each peak
is its own), with the other options as given, and prints one JSON of every point (each point's JSON also goes to
stderr as it finishes; a point that fails is recorded with its exit status and the tail of its output):
``OMP_NUM_THREADS=2 .venv/bin/python -m benchmarks.circuits.scale --model smollm2 --k 8 --max-feature-nodes 1000
--max-memory 8 --no-prune --curve 64,128,256,512,1024``.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.circuits.scale --model smollm2 --tokens 16 --k 8``; a long
prompt under a bound: ``... --tokens 256 --layers 4 --k 2 --max-memory 1.0``; on a GPU: ``--random-weights --tokens 1024
--k 1 --device cuda --max-memory 16 --no-prune`` (docs/circuits.md).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from benchmarks.harness import ROOT, emit, max_rss_mib, peak_mib, reset_peak, resident_mib, run_module
from gradpatch import PatchableGraph, testing
from gradpatch.circuits import (AttributionGraph, ReplacementModel, attribute, completeness, graph_influence,
                                graph_scores, prune_graph)
from gradpatch.circuits.attribute import DEFAULT_MAX_FEATURE_NODES, memory_per_row
from gradpatch.dictionaries import SkipTranscoder
from gradpatch.patches import AddPatch

PROMPT = "The capital of France is Paris. The capital of Italy is Rome. The capital of"


def _smollm2(args: argparse.Namespace) -> ReplacementModel:
    if args.random_weights:
        model = testing.tiny_llama(49152, hidden=576, intermediate=1536, layers=30, init_std=0.02,
                                   num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True,
                                   max_position_embeddings=max(2048, args.tokens), rms_norm_eps=1e-5,
                                   rope_theta=100000.0, bos_token_id=1, eos_token_id=2, pad_token_id=None)
        ids = torch.randint(0, 49152, (1, args.tokens), generator=torch.Generator().manual_seed(1))
    else:
        from gradpatch.files.loaders import load_embedded_model

        model, tokenizer = load_embedded_model()
        text = " ".join([PROMPT] * (1 + args.tokens // 16))
        ids = tokenizer(text, return_tensors="pt").input_ids[:, :args.tokens]
    model, ids = model.to(args.device), ids.to(args.device)
    generator = torch.Generator().manual_seed(0)
    layers = range(args.layers or model.config.num_hidden_layers)
    transcoders = {layer: SkipTranscoder(576, args.latents, activation="topk", k=args.k,
                                         input_node=f"model.layers_{layer}.mlp.x",
                                         output_node=f"model.layers_{layer}.mlp.output",
                                         generator=generator).to(args.device) for layer in layers}
    return ReplacementModel(PatchableGraph(model, ids, use_cache=False), transcoders, ids)


def _tiny(name: str) -> ReplacementModel:
    sys.path.insert(0, str(ROOT / "tests" / "circuits"))
    from test_circuits import tiny_replacement

    return tiny_replacement(name, torch.randint(0, 100, (1, 7), generator=torch.Generator().manual_seed(3)))


class _PeakMemory:
    """The peak memory during a block: the kernel's resident high-water mark on the CPU (``VmHWM``, reset on entry;
    benchmarks/harness.py), the allocator's peak on CUDA; :attr:`peak` and :attr:`before` in bytes."""

    def __init__(self, device: str) -> None:
        self.cuda = device.startswith("cuda")
        self.peak = self.before = 0

    def __enter__(self) -> _PeakMemory:
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.before = torch.cuda.memory_allocated()
        else:
            reset_peak()
            self.before = int(resident_mib() * 2**20)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated()
        else:
            self.peak = int(peak_mib() * 2**20)


def _exactness(model: ReplacementModel, graph: AttributionGraph) -> dict[str, float]:
    """err = |h − Σ_s A[h, s] − bias(h)| over every feature node (module docstring), from
    :func:`~gradpatch.circuits.completeness` (bias(h): h with every source of the graph removed)."""
    found = completeness(model, graph)
    features = slice(0, graph.n_features)
    error = (found.values - found.edges - found.biases).abs()[features]
    relative = error / found.values[features].abs()
    return {"worst_error_of_terms": float(found.errors[features].max()),
            "median_error_of_target": float(relative.median()),
            "share_error_of_target_le_1e-4": float((relative <= 1e-4).float().mean())}


def _sweep(model: ReplacementModel, graph: AttributionGraph, forwards: int) -> dict[str, float]:
    """Seconds per forward pass with one feature ablated, and their product with the number of features."""
    chosen = torch.randperm(graph.n_features, generator=torch.Generator().manual_seed(0))[:forwards].tolist()
    start = time.perf_counter()
    for index in chosen:
        layer, position, feature = graph.active_features[index].tolist()
        spliced = model.layers[layer]
        delta = torch.zeros_like(spliced.outputs)
        delta[0, position] = -float(graph.activations[index]) * spliced.transcoder.W_dec[feature].detach()
        with torch.no_grad(), model.pg.patch({spliced.output_node: [AddPatch(value=delta)]}):
            model.pg(model.ids, **model.forward_kwargs)
    if model.ids.is_cuda:
        torch.cuda.synchronize()
    per_forward = (time.perf_counter() - start) / len(chosen)
    return {"sweep_forwards_timed": len(chosen), "sweep_seconds_per_forward": round(per_forward, 4),
            "sweep_seconds_extrapolated": round(per_forward * graph.n_features, 1)}


def _curve(args: argparse.Namespace, argv: list[str]) -> None:
    """One run of this script per length of ``args.curve``, each in its own process (module docstring)."""
    points = []
    for tokens in [int(text) for text in args.curve.split(",")]:
        start = time.perf_counter()
        result = run_module(sys.executable, "benchmarks.circuits.scale", [*argv, "--tokens", str(tokens)],
                            check=False)
        if result.returncode == 0:
            point = json.loads(result.stdout[result.stdout.index("{"):])
            point.pop("header")
        else:
            point = {"tokens": tokens, "exit_status": result.returncode,
                     "output_tail": (result.stdout + result.stderr)[-2000:]}
        point["process_seconds"] = round(time.perf_counter() - start, 1)
        print(json.dumps(point), file=sys.stderr, flush=True)
        points.append(point)
    emit({"curve": points, "arguments": argv}, device=args.device, indent=1)


def _without_curve(argv: list[str]) -> list[str]:
    """The command-line arguments without ``--curve`` and its value (and without ``--tokens``)."""
    kept, skip = [], False
    for text in argv:
        if skip:
            skip = False
        elif text in ("--curve", "--tokens"):
            skip = True
        elif not text.startswith(("--curve=", "--tokens=")):
            kept.append(text)
    return kept


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["smollm2", "tiny-llama", "tiny-gpt2"], default="smollm2")
    parser.add_argument("--random-weights", action="store_true", help="smollm2's shape with random weights")
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--curve", default=None, metavar="T1,T2,...",
                        help="one run per prompt length, each in its own process; one JSON of all")
    parser.add_argument("--layers", type=int, default=0, help="transcoders at the first N MLPs (0: all)")
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--latents", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--max-feature-nodes", type=int, default=DEFAULT_MAX_FEATURE_NODES,
                        help="features whose rows are computed, chosen by influence (0: every feature)")
    parser.add_argument("--max-memory", type=float, default=None, help="GiB bound (max_memory_bytes)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--sweep", type=int, default=0, help="forwards timed for the exact sweep's cost")
    parser.add_argument("--no-prune", action="store_true")
    parser.add_argument("--keep-first-position", action="store_true",
                        help="position 0's features and errors as nodes (default: circuit-tracer's convention)")
    args = parser.parse_args()
    if args.curve:
        _curve(args, _without_curve(sys.argv[1:]))
        return
    start = time.perf_counter()
    model = _smollm2(args) if args.model == "smollm2" else _tiny(args.model[5:])
    built = time.perf_counter() - start
    start = time.perf_counter()
    with torch.no_grad():  # extracts the graphs for batches of 2 or more rows (once per PatchableGraph), untimed
        model.run(2)
    extracted = time.perf_counter() - start
    bound = None if args.max_memory is None else int(args.max_memory * 2**30)
    limit = args.max_feature_nodes or None
    first = 0 if args.keep_first_position else 1
    n_features = sum(int(s.activations[:, first:].count_nonzero()) for s in model.layers.values())
    n_nodes = n_features + (len(model.layers) + 1) * model.ids.shape[1] + 10  # at most 10 logits
    n_rows = min(limit or n_features, n_features) + 10
    fixed, per_row = memory_per_row(model, n_nodes, n_rows)  # plan_batch_size's arithmetic, without measuring again
    batch = max(1, min(args.batch_size, n_rows, args.batch_size if bound is None else (bound - fixed) // per_row))
    with _PeakMemory(args.device) as memory:
        start, cpu = time.perf_counter(), time.process_time()
        graph = attribute(model, max_feature_nodes=limit, batch_size=args.batch_size, max_memory_bytes=bound,
                          zero_first_position=not args.keep_first_position)
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    n_targets = graph.n_features + len(graph.logit_tokens)
    with torch.no_grad():
        replay = bool(torch.equal(model.run().logits, model.logits))
    report = {
        "model": args.model + (" (random weights)" if args.random_weights else ""), "device": args.device,
        "tokens": int(model.ids.shape[1]), "layers": len(model.layers), "k": args.k,
        "zero_first_position": graph.zero_first_position,
        "frozen": {"attention": len(model.frozen.attention), "norms": len(model.frozen.norms),
                   "layer_norms": len(model.frozen.layer_norms)},
        "replay_bit_exact": replay, "build_seconds": round(built, 2),
        "extract_batch_seconds": round(extracted, 2), "active_features": graph.total_features,
        "max_feature_nodes": limit, "features": graph.n_features, "nodes": graph.n_nodes,
        "logits": len(graph.logit_tokens), "attribute_seconds": round(seconds, 2),
        "attribute_cpu_seconds": round(cpu, 2), "batch_size_asked": args.batch_size, "batch_size_used": batch,
        "backward_passes": -(-n_targets // batch), "estimate_fixed_gib": round(fixed / 2**30, 3),
        "estimate_per_row_gib": round(per_row / 2**30, 4), "max_memory_gib": args.max_memory,
        "rows_gib": round(graph.rows.numel() * 4 / 2**30, 3),
        "dense_adjacency_gib": round(graph.n_nodes ** 2 * 4 / 2**30, 3),
        "memory_before_gib": round(memory.before / 2**30, 3), "peak_memory_gib": round(memory.peak / 2**30, 3),
        "peak_above_before_gib": round((memory.peak - memory.before) / 2**30, 3),
        "max_rss_gib": round(max_rss_mib() / 1024, 2),
        **_exactness(model, graph)}
    if not args.no_prune:
        with _PeakMemory(args.device) as memory:
            start = time.perf_counter()
            unpruned = graph_influence(graph)
            pruned = prune_graph(graph, unpruned=unpruned)
            replacement, completeness_score = graph_scores(graph, unpruned)
            prune_seconds = time.perf_counter() - start
        report.update({"replacement_score": replacement, "completeness_score": completeness_score,
                       "pruned_nodes": int(pruned.node_mask.sum()), "pruned_edges": int(pruned.edge_mask.sum()),
                       "prune_seconds": round(prune_seconds, 2),
                       "prune_peak_memory_gib": round(memory.peak / 2**30, 3)})
    if args.sweep:
        report.update(_sweep(model, graph, args.sweep))
    emit(report, device=args.device, indent=1)


if __name__ == "__main__":
    main()
