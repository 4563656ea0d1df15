"""circuit-tracer's side of benchmarks/dictionaries/circuit_tracer_files.py, run in a virtualenv where circuit-tracer
imports (it imports no gradpatch).

``outputs CONFIG``: loads the transcoder set ``CONFIG`` (a ``config.yaml``) with circuit-tracer's
``load_transcoder_set`` on the CPU and writes, beside it, ``circuit_tracer_outputs_<layer>.safetensors`` for each
layer: the inputs ``x`` ``[64, d_model]`` (seed 0), the transcoder's ``encode(x)`` and its ``forward(x)`` (decoder
and skip term).

Run (from the repository's root): ``.peers/circuit_tracer_d797c82/bin/python -m
benchmarks.peers.circuit_tracer.files_side outputs CONFIG``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from circuit_tracer.transcoder import load_transcoder_set
from safetensors.torch import save_file


def outputs(config: Path) -> None:
    settings = load_transcoder_set(str(config), device=torch.device("cpu"), dtype=torch.float32)
    for layer, transcoder in settings.transcoders.items():
        x = torch.randn(64, transcoder.d_model, generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            tensors = {"x": x, "latents": transcoder.encode(x), "forward": transcoder(x)}
        save_file({name: t.contiguous() for name, t in tensors.items()},
                  str(config.parent / f"circuit_tracer_outputs_{layer}.safetensors"))


if __name__ == "__main__":
    command, path = sys.argv[1], Path(sys.argv[2])
    {"outputs": outputs}[command](path)
