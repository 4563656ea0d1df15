"""Attribution graphs (gradpatch.circuits): size, time, memory and exactness on one prompt; prints JSON.

Models: ``smollm2`` (the embedded SmolLM2-135M, 30 layers; TopK skip transcoders with random weights, 1,024 latents,
k = ``--k``, at every MLP) or the test suite's ``tiny-llama`` / ``tiny-gpt2`` (ReLU skip transcoders, 64 latents,
at both MLPs, as tests/test_circuits.py builds them). For each: the frozen nodes found, whether the replay is the
model bit for bit, the graph's size, the seconds of :func:`~gradpatch.circuits.attribute`, the peak resident memory,
and the exactness of the linearisation over every feature node, err = |h − Σ_s A[h, s] − bias(h)| as a fraction of
Σ_s |A[h, s]| + |bias(h)| (worst) and of |h| (median; share ≤ 1e-4); the replacement and completeness scores and the
pruned graph's size (circuit-tracer's default thresholds).

Run: ``OMP_NUM_THREADS=2 .venv/bin/python benchmarks/circuits.py --model smollm2 --tokens 8 --k 2``
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

import torch

from gradpatch import PatchableGraph
from gradpatch.circuits import ReplacementModel, attribute, graph_scores, prune_graph
from gradpatch.dictionaries import SkipTranscoder

PROMPT = "The capital of France is Paris. The capital of Italy is Rome. The capital of"


def _smollm2(tokens: int, k: int) -> ReplacementModel:
    from gradpatch.files.loaders import load_embedded_model

    model, tokenizer = load_embedded_model()
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids[:, :tokens]
    generator = torch.Generator().manual_seed(0)
    transcoders = {layer: SkipTranscoder(576, 1024, activation="topk", k=k, input_node=f"model.layers_{layer}.mlp.x",
                                         output_node=f"model.layers_{layer}.mlp.output", generator=generator)
                   for layer in range(model.config.num_hidden_layers)}
    return ReplacementModel(PatchableGraph(model, ids, use_cache=False), transcoders, ids)


def _tiny(name: str) -> ReplacementModel:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from test_circuits import tiny_replacement

    return tiny_replacement(name, torch.randint(0, 100, (1, 7), generator=torch.Generator().manual_seed(3)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["smollm2", "tiny-llama", "tiny-gpt2"], default="smollm2")
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--k", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args()
    start = time.perf_counter()
    model = _smollm2(args.tokens, args.k) if args.model == "smollm2" else _tiny(args.model[5:])
    built = time.perf_counter() - start
    with torch.no_grad():
        full = model.run()
        bias = model.run(1, {layer: -(s.constant - s.transcoder.b_dec) for layer, s in model.layers.items()},
                         -model.embeddings)
    start = time.perf_counter()
    graph = attribute(model, batch_size=args.batch_size)
    seconds = time.perf_counter() - start
    of_terms, of_target = [], []
    for row, (layer, position, feature) in enumerate(graph.active_features.tolist()):
        h, b = full.pre_activations[layer][0, position, feature], bias.pre_activations[layer][0, position, feature]
        error = (h - graph.adjacency[row].sum() - b).abs()
        of_terms.append(float(error / (graph.adjacency[row].abs().sum() + b.abs())))
        of_target.append(float(error / h.abs()))
    relative = torch.tensor(of_target)
    pruned = prune_graph(graph)
    replacement, completeness = graph_scores(graph)
    print(json.dumps({
        "model": args.model, "tokens": int(model.ids.shape[1]), "layers": len(model.layers),
        "frozen": {"attention": len(model.frozen.attention), "norms": len(model.frozen.norms),
                   "layer_norms": len(model.frozen.layer_norms)},
        "replay_bit_exact": bool(torch.equal(full.logits, model.logits)), "build_seconds": round(built, 2),
        "features": graph.n_features, "nodes": int(graph.adjacency.shape[0]), "logits": len(graph.logit_tokens),
        "attribute_seconds": round(seconds, 2), "batch_size": args.batch_size,
        "max_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
        "worst_error_of_terms": max(of_terms), "median_error_of_target": float(relative.median()),
        "share_error_of_target_le_1e-4": float((relative <= 1e-4).float().mean()),
        "replacement_score": replacement, "completeness_score": completeness,
        "pruned_nodes": int(pruned.node_mask.sum()), "pruned_edges": int(pruned.edge_mask.sum())}, indent=1))


if __name__ == "__main__":
    main()
