"""Seconds and memory of QK attributions and head loadings on SmolLM2-135M (docs/attention.md); prints JSON.

The embedded SmolLM2-135M in float32 on the CPU, random TopK skip transcoders (256 latents, ``--k`` active per
position, decoder scaled by 0.05) at all 30 MLPs, the 16-token IOI-style prompt of tests/circuits (BOS + "When Mary
and John went to the store, John gave a cold drink to"). Measured, each stretch's wall and CPU seconds and the peak
resident memory during it (``VmHWM`` reset before it, benchmarks.harness) with the resident memory before it:

- ``attribute``: the graph;
- ``patterns``: the pattern rows of every head at the last position (one forward pass per attention layer);
- ``qk``: the QK decomposition of the top 10 heads (largest pattern weight on a key other than position 0 from the
  last position), each at that key: ``qk_attributions`` with ``--batch-size`` rows per pass; and the worst
  reconstruction of the ten, |Σ T + m − s| / |s| and / Σ|T|;
- ``head_loadings``: the edges into the top logit from its 20 strongest sources, split at every layer (the rows
  computed on a float64 copy of the model, its building included), and the worst |Σ_h loading + bypass − A| / |A|
  over the edges and layers;
- ``example`` (docs/attention.md's worked example): the head of layers ≥ 1 that weighs " Mary" (position 2) most
  from the last position (a name-mover candidate), its score at that key decomposed, the top 10 terms with labels.

Run: ``.venv/bin/python -m benchmarks.circuits.qk_cost`` (``--k 4 --batch-size 256 --threads N
--loadings-batch-size 512``).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

from benchmarks.harness import emit, peak_mib, reset_peak, resident_mib

PROMPT = "When Mary and John went to the store, John gave a cold drink to"


def _measured(fn: Callable[[], Any]) -> tuple[Any, dict[str, float]]:
    before = resident_mib()
    reset_peak()
    wall, cpu = time.perf_counter(), time.process_time()
    value = fn()
    return value, {"wall_s": round(time.perf_counter() - wall, 2), "cpu_s": round(time.process_time() - cpu, 2),
                   "resident_before_mib": round(before, 1), "peak_mib": round(peak_mib(), 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k", type=int, default=4, help="active latents per position (default %(default)s)")
    parser.add_argument("--batch-size", type=int, default=256, help="rows per QK pass (default %(default)s)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--loadings-batch-size", type=int, default=512,
                        help="rows per head-loading pass (default %(default)s: the target's 301 rows in one pass; "
                             "61: five passes of 6 attention layers)")
    args = parser.parse_args()

    import torch

    from gradpatch import PatchableGraph
    from gradpatch.circuits import ReplacementModel, attribute
    from gradpatch.circuits.heads import head_loadings
    from gradpatch.circuits.qk import pattern_row, qk_attributions, source_label
    from gradpatch.dictionaries import SkipTranscoder
    from gradpatch.files.loaders import load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_model(None)
    ids = torch.cat([torch.tensor([[tokenizer.bos_token_id]]), tokenizer(PROMPT, return_tensors="pt").input_ids], 1)
    pg = PatchableGraph(model, ids, use_cache=False)
    generator = torch.Generator().manual_seed(0)
    transcoders = {}
    for layer in range(model.config.num_hidden_layers):
        transcoder = SkipTranscoder(model.config.hidden_size, 256, activation="topk", k=args.k,
                                    input_node=f"model.layers_{layer}.mlp.x",
                                    output_node=f"model.layers_{layer}.mlp.output", generator=generator)
        with torch.no_grad():
            transcoder.W_dec.mul_(0.05)
        transcoders[layer] = transcoder
    replacement = ReplacementModel(pg, transcoders, ids)
    graph, attribute_cost = _measured(lambda: attribute(replacement, batch_size=128))
    last = ids.shape[1] - 1
    rows, pattern_cost = _measured(lambda: torch.stack([pattern_row(replacement, layer, last)
                                                        for layer in range(model.config.num_hidden_layers)]))
    heads = rows.shape[1]
    weights, keys = rows[:, :, 1:].max(-1)
    top = weights.flatten().topk(10).indices.tolist()
    requests = [(i // heads, i % heads, last, int(keys.flatten()[i]) + 1) for i in top]
    attributions, qk_cost = _measured(lambda: qk_attributions(replacement, graph, requests,
                                                              batch_size=args.batch_size))
    misses = [a.reconstruction() + (abs(a.score),) for a in attributions]
    strongest = graph.rows[graph.n_features, :graph.logit_start].abs().topk(20).indices.tolist()
    loadings, loading_cost = _measured(lambda: head_loadings(replacement, graph, [graph.logit_start], [strongest],
                                                             batch_size=args.loadings_batch_size))
    split_misses = [abs(float(per_head.sum()) + bypass - weight) / abs(weight)
                    for target, source, weight in loadings.edges.tolist()
                    for per_head, bypass in loadings.edge(int(target), int(source)).values()]
    mary = 2
    candidates = rows[1:, :, mary].flatten()
    best = int(candidates.argmax())
    layer, head = best // heads + 1, best % heads
    (example,) = qk_attributions(replacement, graph, [(layer, head, last, mary)], batch_size=args.batch_size)
    missed, size = example.reconstruction()
    decode = tokenizer.decode
    worked = {"layer": layer, "head": head, "query_position": last, "key_position": mary,
              "key_token": decode([int(ids[0, mary])]), "pattern": round(float(rows[layer, head, mary]), 4),
              "score": example.score, "missed": missed, "terms_abs_sum": size,
              "top_terms": [{"value": round(t.value, 4), "query": source_label(graph, t.query_node, _single(decode)),
                             "key": source_label(graph, t.key_node, _single(decode))}
                            for t in example.top_terms(10)]}
    emit({"benchmark": "circuits.qk_cost", "model": "SmolLM2-135M float32", "tokens": int(ids.shape[1]),
          "transcoders": f"30 random TopK skip transcoders, 256 latents, k={args.k}", "threads":
          torch.get_num_threads(), "features": graph.n_features, "nodes": graph.n_nodes,
          "heads": [{"layer": a.layer, "head": a.head, "key": a.key_position, "pattern": round(float(
              rows[a.layer, a.head, a.key_position]), 4)} for a in attributions],
          "attribute": attribute_cost, "patterns": pattern_cost, "qk_top10": qk_cost,
          "qk_worst_miss_of_score": max(m / s for m, _, s in misses),
          "qk_worst_miss_of_terms": max(m / t for m, t, _ in misses),
          "head_loadings_top_logit_20_edges": loading_cost, "head_loadings_worst_miss_of_edge": max(split_misses),
          "example": worked})


def _single(decode: Callable[[list[int]], str]) -> Callable[[int], str]:
    """A tokenizer's ``decode`` of a list as a decoder of one id."""
    return lambda token: decode([token])


if __name__ == "__main__":
    main()
