"""SAELens's side of benchmarks/dictionaries/saelens_files.py, run in SAELens's own virtualenv (it imports no
gradpatch).

``make DIR``: one SAE per SAELens architecture gradpatch reads, built by SAELens (``SAE.from_dict``) with random
parameters (seeded; JumpReLU thresholds in [−0.1, 0.4]; TopK with ``rescale_acts_by_decoder_norm``), saved with
``SAE.save_model`` to ``DIR/<architecture>/``. ``check DIR``: each ``DIR/<architecture>/`` loaded with
``SAE.load_from_disk`` (the folders gradpatch exported). Both write, beside each SAE, ``saelens_outputs.safetensors``:
the inputs ``x`` ``[64, d_in]`` (seed 0), SAELens's ``encode(x)``, ``decode(encode(x))`` and ``forward(x)``.

``evaluate DIR``: SAELens's reconstruction metrics (``sae_lens.evals.get_recons_loss`` on each batch of
``DIR/tokens.safetensors``, averaged over all tokens as ``get_downstream_reconstruction_metrics`` averages them) of
each SAE folder in ``DIR/saes/``, on the Hugging Face model saved in ``DIR/model`` wrapped by ``HookedProxyLM``;
written to ``DIR/saes/<name>/saelens_metrics.json``.

Run (from the repository's root): ``.peers/saelens/bin/python -m benchmarks.peers.saelens.saelens_side
make|check|evaluate DIR``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from sae_lens import SAE
from sae_lens.evals import get_recons_loss
from sae_lens.load_model import HookedProxyLM
from sae_lens.training.activation_scaler import ActivationScaler
from transformers import AutoModelForCausalLM, AutoTokenizer

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


def evaluate(root: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(root / "model", dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(root / "model")
    batches = [tokens for _, tokens in sorted(load_file(str(root / "tokens.safetensors")).items())]
    for folder in sorted(path for path in (root / "saes").iterdir() if path.is_dir()):
        sae = SAE.load_from_disk(folder)
        proxy = HookedProxyLM(model, tokenizer, hook_names=[sae.cfg.metadata.hook_name])
        values: dict[str, list[torch.Tensor]] = {}
        with torch.no_grad():
            for tokens in batches:
                metrics = get_recons_loss(sae, proxy, ActivationScaler(), tokens, compute_kl=True,
                                          compute_ce_loss=True)
                for name, value in metrics.items():
                    values.setdefault(name, []).append(value.flatten())
        means = {name: float(torch.cat(parts).mean()) for name, parts in values.items()}
        means["ce_loss_score"] = (means["ce_loss_with_ablation"] - means["ce_loss_with_sae"]) / (
            means["ce_loss_with_ablation"] - means["ce_loss_without_sae"])
        (folder / "saelens_metrics.json").write_text(json.dumps(means))


if __name__ == "__main__":
    command, directory = sys.argv[1], Path(sys.argv[2])
    {"make": make, "check": check, "evaluate": evaluate}[command](directory)
