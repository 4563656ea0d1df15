"""circuit-tracer's side of ``benchmarks/circuits/scale.py --peer``, run in a virtualenv where circuit-tracer 0.5.0
imports (it imports no gradpatch).

``graph FOLDER``: reads ``FOLDER/model`` (a Hugging Face model folder), the transcoder set
``FOLDER/transcoders/config.yaml`` (exported by :func:`gradpatch.dictionaries.export_circuit_tracer` as ReLU skip
transcoders) and ``FOLDER/prompt.json`` (``{"ids": [...], "batch_size": b, "k": k, "max_feature_nodes": N}``);
builds circuit-tracer's TransformerLens replacement model on the CPU in float32
(:func:`benchmarks.peers.circuit_tracer.graphs_side.replacement_model`), gives every transcoder the activation of
gradpatch's ``topk`` (ReLU(TopK_k(h)): circuit-tracer 0.5.0 loads only ReLU and JumpReLU files, and its
``encode_sparse`` calls the transcoder's ``activation_function``), and runs its ``attribute`` with
``max_feature_nodes=N`` and the batch size ``b`` (its default logit selection). Writes
``FOLDER/circuit_tracer_rows.safetensors``: ``rows`` ``[N + n_logits, n_kept]`` (the selected features' rows then
the logits' rows of circuit-tracer's adjacency; columns: the selected features, errors, tokens, logits),
``features`` ``[N, 3]`` (layer, position, latent of the selected features), ``activations`` ``[N]``,
``logit_tokens``, ``logit_probabilities``; and ``FOLDER/circuit_tracer_run.json``: seconds of the load and of
``attribute``, CPU seconds of ``attribute`` (all threads), the 1-minute load average before and after, the resident
memory after the load and the kernel's resident high-water mark (``VmHWM``) reset before ``attribute``, the
process's peak since it started, and the graph's counts.

Run (from the repository's root): ``.peers/circuit_tracer/bin/python -m benchmarks.peers.circuit_tracer.scale_side
graph FOLDER``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from benchmarks.harness import max_rss_mib, peak_mib, reset_peak, resident_mib
from benchmarks.peers.circuit_tracer.graphs_side import replacement_model


class ReluTopK(torch.nn.Module):
    """ReLU(TopK_k(h)) along the last dimension, as gradpatch's ``topk`` activation: each position keeps its ``k``
    largest pre-activations, clamped at 0 (``h`` ``[..., m]`` -> ``[..., m]``)."""

    def __init__(self, k: int) -> None:
        super().__init__()
        self.k = k

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        values, indices = torch.topk(h, self.k, dim=-1, sorted=False)
        return torch.zeros_like(h).scatter(-1, indices, values.relu())


def graph(folder: Path) -> None:
    """circuit-tracer's graph of ``folder``'s prompt with at most N feature nodes (module docstring)."""
    from circuit_tracer import attribute

    prompt = json.loads((folder / "prompt.json").read_text())
    start = time.perf_counter()
    model = replacement_model(folder, "transformerlens")
    for transcoder in model.transcoders:
        transcoder.activation_function = ReluTopK(prompt["k"])
    loaded = time.perf_counter() - start
    rss_loaded = resident_mib() / 1024
    reset_peak()
    start, cpu, load = time.perf_counter(), time.process_time(), os.getloadavg()[0]
    result = attribute(torch.tensor(prompt["ids"]), model, batch_size=prompt["batch_size"],
                       max_feature_nodes=prompt["max_feature_nodes"])
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    peak = peak_mib() / 1024
    selected = result.selected_features
    n_logits = len(result.logit_targets)
    rows = torch.cat([result.adjacency_matrix[:len(selected)], result.adjacency_matrix[-n_logits:]])
    save_file({"rows": rows.float().contiguous(),
               "features": result.active_features[selected].long().contiguous(),
               "activations": result.activation_values[selected].float().contiguous(),
               "logit_tokens": torch.tensor([t.vocab_idx for t in result.logit_targets]).long(),
               "logit_probabilities": result.logit_probabilities.float().contiguous()},
              str(folder / "circuit_tracer_rows.safetensors"))
    (folder / "circuit_tracer_run.json").write_text(json.dumps({
        "backend": "transformerlens", "load_seconds": round(loaded, 2), "attribute_seconds": round(seconds, 2),
        "attribute_cpu_seconds": round(cpu, 2), "load_average_1min": [round(load, 1), round(os.getloadavg()[0], 1)],
        "rss_after_load_gib": round(rss_loaded, 3), "peak_rss_during_attribute_gib": round(peak, 3),
        "peak_above_after_load_gib": round(peak - rss_loaded, 3), "max_rss_gib": round(max_rss_mib() / 1024, 3),
        "active_features": int(result.active_features.shape[0]), "features": int(len(selected)),
        "nodes": int(result.adjacency_matrix.shape[0]), "logits": n_logits,
        "torch_threads": torch.get_num_threads()}))


if __name__ == "__main__":
    command, path = sys.argv[1], Path(sys.argv[2])
    {"graph": graph}[command](path)
