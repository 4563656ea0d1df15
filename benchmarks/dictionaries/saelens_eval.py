"""evaluate_dictionary against SAELens's evaluation: the same SAEs on the same tokens of SmolLM2-135M-Instruct.

The embedded SmolLM2-135M-Instruct (float32, CPU) is saved as a plain ``from_pretrained`` folder in a temporary
folder (``benchmarks/harness.py``'s ``save_for_peers``); two SAEs
at the output of decoder layer ``--layer`` (NodePath ``model.layers_<L>.output``, SAELens hook ``model.layers.<L>``
on its ``HookedProxyLM``) are exported in SAELens's layout: a random TopK SAE (4× width, k = 32) and an exact ReLU SAE
(latents [x, −x] decoded by [I; −I]). The tokens are the toy sentences of :mod:`gradpatch.testing`, concatenated and
cut into ``--batches`` batches of 4 × 12 tokens. gradpatch's :func:`~gradpatch.dictionaries.evaluate_dictionary` and
SAELens 6.54's ``get_recons_loss`` (benchmarks/peers/saelens/saelens_side.py, in SAELens's virtualenv) each score both.
Prints JSON: per SAE, both sides' CE losses (original, spliced, zero-ablated), CE loss recovered and KL, and their
largest absolute difference.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.dictionaries.saelens_eval`` (SAELens from
``.peers/saelens``, ``make peers PEERS=saelens``; ``--python`` names another).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from benchmarks.harness import emit, peer_python, run_module, save_for_peers
from gradpatch import PatchableGraph, testing
from gradpatch.dictionaries import SparseAutoencoder, evaluate_dictionary, export_saelens
from gradpatch.files.loaders import load_embedded_model

#: SAELens's metric name -> evaluate_dictionary's.
NAMES = {"ce_loss_without_sae": "ce_loss_original", "ce_loss_with_sae": "ce_loss_spliced",
         "ce_loss_with_ablation": "ce_loss_zero_ablation", "ce_loss_score": "ce_loss_recovered",
         "kl_div_with_sae": "kl"}


def saes(width: int, node: str) -> dict[str, SparseAutoencoder]:
    """The random TopK SAE and the exact ReLU SAE at ``node``."""
    exact = SparseAutoencoder(width, 2 * width, "relu", node=node, apply_b_dec_to_input=False)
    with torch.no_grad():
        exact.W_enc.copy_(torch.cat([torch.eye(width), -torch.eye(width)], dim=1))
        exact.W_dec.copy_(torch.cat([torch.eye(width), -torch.eye(width)]))
    random = SparseAutoencoder(width, 4 * width, "topk", 32, node=node, generator=torch.Generator().manual_seed(0))
    return {"exact_relu": exact, "random_topk": random}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", help="the Python of SAELens's virtualenv (default: .peers/saelens/bin/python)")
    parser.add_argument("--layer", type=int, default=12)
    parser.add_argument("--batches", type=int, default=2)
    args = parser.parse_args()
    model, tokenizer = load_embedded_model()
    ids = tokenizer(" ".join(testing.TOY_SENTENCES), return_tensors="pt").input_ids[0]
    if ids.numel() < 48 * args.batches:
        raise SystemExit(f"the toy sentences hold {ids.numel()} tokens, fewer than {48 * args.batches}")
    batches = [ids[i * 48:(i + 1) * 48].reshape(4, 12) for i in range(args.batches)]
    pg = PatchableGraph(model, batches[0], use_cache=False)
    node, hook = f"model.layers_{args.layer}.output", f"model.layers.{args.layer}"
    report = {}
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        save_for_peers(model, tokenizer, root / "model")
        save_file({f"batch_{i:03d}": batch.contiguous() for i, batch in enumerate(batches)},
                  str(root / "tokens.safetensors"))
        ours = {}
        for name, sae in saes(model.config.hidden_size, node).items():
            export_saelens(sae, root / "saes" / name, hook_name=hook)
            ours[name] = evaluate_dictionary(pg, sae, batches).to_dict()
        run_module(peer_python("saelens", args.python), "benchmarks.peers.saelens.saelens_side",
                   ["evaluate", str(root)])
        for name, metrics in ours.items():
            theirs = json.loads((root / "saes" / name / "saelens_metrics.json").read_text())
            pairs = {ours_name: {"gradpatch": metrics[ours_name], "saelens": theirs[their_name]}
                     for their_name, ours_name in NAMES.items()}
            report[name] = {"metrics": pairs, "max_abs_difference": max(
                abs(pair["gradpatch"] - pair["saelens"]) for pair in pairs.values())}
    emit({"node": node, "tokens": 48 * args.batches, "saes": report})


if __name__ == "__main__":
    main()
