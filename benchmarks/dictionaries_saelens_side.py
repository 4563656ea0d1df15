"""SAELens's side of benchmarks/dictionaries_saelens.py, run in SAELens's own virtualenv (it imports no gradpatch).

``make DIR``: one SAE per SAELens architecture gradpatch reads, built by SAELens (``SAE.from_dict``) with random
parameters (seeded; JumpReLU thresholds in [−0.1, 0.4]; TopK with ``rescale_acts_by_decoder_norm``), saved with
``SAE.save_model`` to ``DIR/<architecture>/``. ``check DIR``: each ``DIR/<architecture>/`` loaded with
``SAE.load_from_disk`` (the folders gradpatch exported). Both write, beside each SAE, ``saelens_outputs.safetensors``:
the inputs ``x`` ``[64, d_in]`` (seed 0), SAELens's ``encode(x)``, ``decode(encode(x))`` and ``forward(x)``.

Run: ``/work/peers/saelens/bin/python benchmarks/dictionaries_saelens_side.py make|check DIR``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from sae_lens import SAE

D_IN, D_SAE, D_OUT = 32, 96, 40
EXTRA: dict[str, dict] = {"standard": {}, "topk": {"k": 8, "rescale_acts_by_decoder_norm": True}, "jumprelu": {},
                          "transcoder": {"d_out": D_OUT}, "skip_transcoder": {"d_out": D_OUT},
                          "jumprelu_transcoder": {"d_out": D_OUT}, "jumprelu_skip_transcoder": {"d_out": D_OUT}}


def write_outputs(sae: SAE, folder: Path) -> None:
    x = torch.randn(64, sae.cfg.d_in, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        latents = sae.encode(x)
        tensors = {"x": x, "latents": latents, "decoded": sae.decode(latents), "forward": sae(x)}
    save_file({name: t.contiguous() for name, t in tensors.items()}, str(folder / "saelens_outputs.safetensors"))


def make(root: Path) -> None:
    generator = torch.Generator().manual_seed(1)
    for architecture, extra in EXTRA.items():
        transcoder = "transcoder" in architecture
        sae = SAE.from_dict({"architecture": architecture, "d_in": D_IN, "d_sae": D_SAE,
                             "apply_b_dec_to_input": not transcoder, **extra})
        with torch.no_grad():
            for name, parameter in sae.named_parameters():
                if name == "threshold":
                    parameter.copy_(torch.rand(parameter.shape, generator=generator) * 0.5 - 0.1)
                else:
                    parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
        sae.save_model(root / architecture)
        write_outputs(sae, root / architecture)


def check(root: Path) -> None:
    for folder in sorted(path for path in root.iterdir() if path.is_dir()):
        write_outputs(SAE.load_from_disk(folder), folder)


if __name__ == "__main__":
    command, directory = sys.argv[1], Path(sys.argv[2])
    {"make": make, "check": check}[command](directory)
