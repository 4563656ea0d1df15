"""sparsify's side of benchmarks/dictionaries/sparsify_files.py, run in sparsify's own virtualenv (it imports no
gradpatch).

``make DIR``: a sparse autoencoder, a transcoder and a skip transcoder built by sparsify (``SparseCoder``, TopK,
k = 8) with random parameters (seeded), saved with ``SparseCoder.save_to_disk`` to ``DIR/<name>/``, and beside each
``sparsify_outputs.safetensors``: the inputs ``x`` ``[64, d_in]`` (seed 0), sparsify's latents (its top-k values
scattered into ``[64, num_latents]``) and its forward output ``sae_out``.

Run (from the repository's root): ``.peers/sparsify/bin/python -m benchmarks.peers.sparsify.files_side make DIR``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from sparsify import SparseCoder, SparseCoderConfig

D_IN, LATENTS, K = 32, 96, 8
KINDS = {"sae": {}, "transcoder": {"transcode": True}, "skip_transcoder": {"transcode": True, "skip_connection": True}}


def make(root: Path) -> None:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(64, D_IN, generator=torch.Generator().manual_seed(0))
    for name, options in KINDS.items():
        coder = SparseCoder(D_IN, SparseCoderConfig(num_latents=LATENTS, k=K, **options))
        with torch.no_grad():
            for parameter in coder.parameters():
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
            coder.save_to_disk(root / name)
            output = coder(x)
            latents = torch.zeros(64, LATENTS).scatter(-1, output.latent_indices, output.latent_acts)
        save_file({"x": x, "latents": latents, "forward": output.sae_out.contiguous()},
                  str(root / name / "sparsify_outputs.safetensors"))


if __name__ == "__main__":
    command, directory = sys.argv[1], Path(sys.argv[2])
    {"make": make}[command](directory)
