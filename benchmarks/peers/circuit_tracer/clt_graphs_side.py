"""circuit-tracer's side of benchmarks/circuits/circuit_tracer_clt_graphs.py, run in a virtualenv where circuit-tracer
imports (it imports no gradpatch).

``graph FOLDER BACKEND``: reads ``FOLDER/model`` (a Hugging Face model folder, as graphs_side.py reads it), the
cross-layer transcoder ``FOLDER/clt`` (circuit-tracer 0.5.0's CLT layout, ``W_enc_{i}`` / ``W_dec_{i}.safetensors``,
as :func:`gradpatch.dictionaries.export_circuit_tracer_clt` writes it; loaded with circuit-tracer's ``load_clt``,
reading ``mlp.hook_in`` and writing ``mlp.hook_out``, in float32, nothing lazy) and ``FOLDER/prompt.json``; builds
circuit-tracer's replacement model with that CLT on the CPU (0.5.0's ``nnsight`` or ``transformerlens`` backend) and
runs its ``attribute`` with every feature node. Writes ``FOLDER/circuit_tracer_graph_BACKEND.safetensors`` and
``FOLDER/circuit_tracer_run_BACKEND.json`` as graphs_side.py's ``graph`` does.

Run (from the repository's root): ``.peers/circuit_tracer/bin/python -m
benchmarks.peers.circuit_tracer.clt_graphs_side graph FOLDER nnsight`` (or ``transformerlens``).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

from benchmarks.peers.circuit_tracer.graphs_side import graph, with_dictionaries


def clt_replacement_model(folder: Path, backend: str) -> Any:
    """circuit-tracer 0.5.0's replacement model of ``folder/model`` with the CLT ``folder/clt``."""
    from circuit_tracer.transcoder.cross_layer_transcoder import load_clt

    clt = load_clt(str(folder / "clt"), feature_input_hook="mlp.hook_in", feature_output_hook="mlp.hook_out",
                   scan="gradpatch-export", device=torch.device("cpu"), dtype=torch.float32, lazy_decoder=False,
                   lazy_encoder=False)
    return with_dictionaries(folder, clt, backend)


if __name__ == "__main__":
    command, path = sys.argv[1], Path(sys.argv[2])
    {"graph": lambda folder, backend="nnsight": graph(folder, backend, build=clt_replacement_model)}[command](
        path, *sys.argv[3:])
