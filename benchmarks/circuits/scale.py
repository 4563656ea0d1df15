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

``--peer`` runs circuit-tracer 0.5.0 on the same point after gradpatch (``--model smollm2`` with every MLP spliced;
each side its own process, one after the other, never together; with ``--curve``, both sides per point): gradpatch's
side writes its model (``config.json`` with ``max_position_embeddings`` = the prompt's length, so that
TransformerLens's per-layer ``[n_ctx, n_ctx]`` causal masks are not SmolLM2's 8,192²), its transcoders (exported by
:func:`~gradpatch.dictionaries.export_circuit_tracer`; circuit-tracer's side gives them the same ReLU(TopK_k)
activation, benchmarks/peers/circuit_tracer/scale_side.py) and the prompt, which is then the BOS token and the first
T − 1 tokens of the text (circuit-tracer prepends a special token to a prompt that lacks one); circuit-tracer runs
``attribute(max_feature_nodes=N, batch_size=--batch-size)`` with its TransformerLens backend in ``--peer-python``
(default ``.peers/circuit_tracer/bin/python``), on as many threads as gradpatch (the environment's). Each point
reports both sides' JSON (circuit-tracer's: seconds, CPU seconds, the resident memory after the load and its
high-water mark during ``attribute``) and the graphs compared on their common feature nodes and logits: the selected
feature sets, max |A_gradpatch − A_circuit-tracer| over the common rows and the common feature, error and token
columns.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.circuits.scale --model smollm2 --tokens 16 --k 8``; a long
prompt under a bound: ``... --tokens 256 --layers 4 --k 2 --max-memory 1.0``; on a GPU: ``--random-weights --tokens 1024
--k 1 --device cuda --max-memory 16 --no-prune`` (docs/circuits.md).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from benchmarks.circuits.circuit_tracer_graphs import save_model_folder
from benchmarks.harness import (ROOT, emit, max_rss_mib, offline_environment, peak_mib, peer_python, reset_peak,
                                resident_mib, run_module)
from gradpatch import PatchableGraph, testing
from gradpatch.circuits import (AttributionGraph, ReplacementModel, attribute, completeness, graph_influence,
                                graph_scores, prune_graph)
from gradpatch.circuits.attribute import DEFAULT_MAX_FEATURE_NODES, memory_per_row
from gradpatch.dictionaries import SkipTranscoder, export_circuit_tracer
from gradpatch.patches import AddPatch

PROMPT = "The capital of France is Paris. The capital of Italy is Rome. The capital of"
PEER_SIDE = "benchmarks.peers.circuit_tracer.scale_side"


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
        if args.peer_folder:  # circuit-tracer's prompts start with a special token
            ids = torch.cat([torch.tensor([[tokenizer.bos_token_id]]), ids[:, :args.tokens - 1]], 1)
    model, ids = model.to(args.device), ids.to(args.device)
    generator = torch.Generator().manual_seed(0)
    layers = range(args.layers or model.config.num_hidden_layers)
    transcoders = {layer: SkipTranscoder(576, args.latents, activation="topk", k=args.k,
                                         input_node=f"model.layers_{layer}.mlp.x",
                                         output_node=f"model.layers_{layer}.mlp.output",
                                         generator=generator).to(args.device) for layer in layers}
    if args.peer_folder:
        _write_peer_inputs(Path(args.peer_folder), model, tokenizer, ids, transcoders, args)
    return ReplacementModel(PatchableGraph(model, ids, use_cache=False), transcoders, ids)


def _write_peer_inputs(folder: Path, model: Any, tokenizer: Any, ids: torch.Tensor,
                       transcoders: dict[int, SkipTranscoder], args: argparse.Namespace) -> None:
    """circuit-tracer's inputs in ``folder`` (module docstring, ``--peer``): ``model/`` (its config's
    ``max_position_embeddings`` the prompt's length), ``transcoders/`` (each TopK transcoder's weights exported as a
    ReLU skip transcoder's; the side script sets ReLU(TopK_k) back) and ``prompt.json``."""
    relu = {}
    for layer, transcoder in transcoders.items():
        twin = SkipTranscoder(576, args.latents, activation="relu", input_node=transcoder.config.input_node,
                              output_node=transcoder.config.output_node)
        twin.load_state_dict(transcoder.state_dict())
        relu[layer] = twin
    export_circuit_tracer(relu, folder / "transcoders", str(folder / "model"), "mlp.hook_in", "mlp.hook_out")
    save_model_folder(model, tokenizer, folder / "model")
    config = json.loads((folder / "model" / "config.json").read_text())
    config["max_position_embeddings"] = int(ids.shape[1])
    (folder / "model" / "config.json").write_text(json.dumps(config, indent=1))
    (folder / "prompt.json").write_text(json.dumps({"ids": ids[0].tolist(), "batch_size": args.batch_size,
                                                    "k": args.k, "max_feature_nodes": args.max_feature_nodes}))


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


def _run_point(python: str, module: str, arguments: list[str], env: dict[str, str] | None = None
               ) -> dict[str, Any]:
    """One process's JSON report (of its header only the commit it started from, ``git_commit``: points of one
    curve run one after the other; none: ``{}``), or its exit status and output's tail when it failed;
    ``process_seconds`` its wall-clock seconds."""
    start = time.perf_counter()
    result = run_module(python, module, arguments, env=env, check=False)
    if result.returncode == 0:
        point = json.loads(result.stdout[result.stdout.index("{"):]) if "{" in result.stdout else {}
        commit = point.pop("header", {}).get("git_commit")
        if commit is not None:
            point["git_commit"] = commit
    else:
        point = {"exit_status": result.returncode, "output_tail": (result.stdout + result.stderr)[-2000:]}
    point["process_seconds"] = round(time.perf_counter() - start, 1)
    return point


def _compare(folder: Path, layers: int) -> dict[str, Any]:
    """gradpatch's and circuit-tracer's graphs (``gradpatch_rows.safetensors``, ``circuit_tracer_rows.safetensors``:
    ``rows`` ``[N + n_logits, n_kept]``, ``features`` ``[N, 3]``, ``logit_tokens``) compared on the common feature
    and logit rows and the common feature, error and token columns (both order the columns as circuit-tracer
    does: the kept features, the errors layer by layer, the tokens, the logits)."""
    sides = [load_file(str(folder / name)) for name in ("gradpatch_rows.safetensors",
                                                         "circuit_tracer_rows.safetensors")]
    seq = len(json.loads((folder / "prompt.json").read_text())["ids"])
    where = [{tuple(f): i for i, f in enumerate(side["features"].tolist())} for side in sides]
    logits = [side["logit_tokens"].tolist() for side in sides]
    common = sorted(set(where[0]) & set(where[1]))
    common_logits = [token for token in logits[0] if token in logits[1]]
    blocks = []
    for side, found, tokens in zip(sides, where, logits):
        n = len(found)
        feature_rows = [found[f] for f in common]
        rows = feature_rows + [n + tokens.index(token) for token in common_logits]
        columns = feature_rows + list(range(n, n + (layers + 1) * seq))
        blocks.append(side["rows"][rows][:, columns].double())
    diff = (blocks[0] - blocks[1]).abs()
    return {"features_gradpatch": len(where[0]), "features_circuit_tracer": len(where[1]),
            "features_common": len(common), "feature_sets_equal": set(where[0]) == set(where[1]),
            "logits_gradpatch": logits[0], "logits_circuit_tracer": logits[1],
            "compared_block": list(diff.shape), "max_abs_diff": float(diff.max()),
            "max_abs": float(blocks[0].abs().max()), "entries_diff_gt_1e-4": int((diff > 1e-4).sum())}


def _peer_point(args: argparse.Namespace, argv: list[str], tokens: int) -> dict[str, Any]:
    """gradpatch's point, then circuit-tracer's on the same inputs (each its own process, in turn), compared."""
    with tempfile.TemporaryDirectory(prefix="scale_peer_") as scratch:
        folder = Path(scratch)
        ours = _run_point(sys.executable, "benchmarks.circuits.scale",
                          [*argv, "--tokens", str(tokens), "--peer-folder", str(folder)])
        point: dict[str, Any] = {"tokens": tokens, "gradpatch": ours}
        if "exit_status" in ours:
            return point
        environment = offline_environment()
        theirs = _run_point(peer_python("circuit_tracer", args.peer_python), PEER_SIDE, ["graph", str(folder)],
                            env=environment)
        if "exit_status" not in theirs:
            theirs.update(json.loads((folder / "circuit_tracer_run.json").read_text()))
            theirs["comparison"] = _compare(folder, ours["layers"])
        point["circuit_tracer"] = theirs
    return point


def _points(args: argparse.Namespace, argv: list[str]) -> None:
    """Each length of ``--curve`` (or ``--tokens``) in its own process(es) (module docstring), one JSON of all."""
    points = []
    for tokens in [int(text) for text in (args.curve or str(args.tokens)).split(",")]:
        if args.peer:
            point = _peer_point(args, argv, tokens)
        else:
            point = {"tokens": tokens, **_run_point(sys.executable, "benchmarks.circuits.scale",
                                                    [*argv, "--tokens", str(tokens)])}
        print(json.dumps(point), file=sys.stderr, flush=True)
        points.append(point)
    emit({"curve": points, "arguments": argv}, device=args.device, indent=1)


def _point_arguments(argv: list[str]) -> list[str]:
    """The command-line arguments of one point's process: without ``--curve``, ``--tokens``, ``--peer`` and
    ``--peer-python`` (and their values)."""
    kept, skip = [], False
    for text in argv:
        if skip:
            skip = False
        elif text in ("--curve", "--tokens", "--peer-python"):
            skip = True
        elif text != "--peer" and not text.startswith(("--curve=", "--tokens=", "--peer-python=")):
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
    parser.add_argument("--peer", action="store_true",
                        help="also circuit-tracer 0.5.0 on each point, after gradpatch (module docstring)")
    parser.add_argument("--peer-python", help="circuit-tracer's Python (default: .peers/circuit_tracer/bin/python)")
    parser.add_argument("--peer-folder", help=argparse.SUPPRESS)  # gradpatch's side of a --peer point
    args = parser.parse_args()
    if (args.peer or args.peer_folder) and (args.model != "smollm2" or args.random_weights or args.layers
                                            or args.keep_first_position or args.device != "cpu"):
        parser.error("--peer needs --model smollm2 with its weights and every MLP spliced (no --random-weights, "
                     "--layers or --keep-first-position), on the CPU")
    if args.curve or args.peer:
        _points(args, _point_arguments(sys.argv[1:]))
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
    with _PeakMemory(args.device) as memory:
        start, cpu = time.perf_counter(), time.process_time()
        graph = attribute(model, max_feature_nodes=limit, batch_size=args.batch_size, max_memory_bytes=bound,
                          zero_first_position=not args.keep_first_position)
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    n_targets = graph.n_features + len(graph.logit_tokens)
    n_nodes = graph.total_features + (len(model.layers) + 1) * model.ids.shape[1] + len(graph.logit_tokens)
    fixed, per_row = memory_per_row(model, n_nodes, n_targets)  # plan_batch_size's arithmetic, after the call
    batch = max(1, min(args.batch_size, n_targets, args.batch_size if bound is None else (bound - fixed) // per_row))
    if args.peer_folder:
        save_file({"rows": graph.rows.contiguous(), "features": graph.active_features.contiguous(),
                   "logit_tokens": graph.logit_tokens.contiguous()},
                  str(Path(args.peer_folder) / "gradpatch_rows.safetensors"))
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
