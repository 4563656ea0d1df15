"""End-to-end against local training of a TopK SAE on SmolLM2-135M-Instruct: same node, k, width, initial weights,
tokens and token order (Braun et al. 2024, arXiv 2405.12241, Table 1: e2e SAEs lose far less CE at equal L0).

SAEs at ``--node`` (default ``model.layers_12.output``, the residual stream after layer 12 of 30), ``--latents``
latents, k = ``--k``, all starting from the same weights (seed 0), each trained by Adam (``--lr``) on the same packed
chunks of the offline Wikipedia summaries (:func:`recipes.dictionary.read_documents`, ``--chunk`` tokens each,
``--batch-size`` chunks per step, one pass over ``--train-tokens``):

- ``local``: :class:`recipes.dictionary.DictionaryModule` (FVU + AuxK/32, unit-norm decoder), its buffer one batch
  long, so each step trains on exactly that step's tokens (in shuffled row order), as the end-to-end runs do;
- ``e2e``: :class:`recipes.dictionary.EndToEndDictionaryModule`, KL(original ‖ spliced);
- ``e2e+ds``: the same plus β_ds (``--ds-coefficient``) times the mean MSE over the downstream residual nodes
  (:func:`recipes.dictionary.downstream_residual_nodes`: layers 13 .. 28's outputs);
- ``local+e2e``: ``local`` for the first 1 − ``--finetune-fraction`` of the steps, then ``e2e`` for the rest (a
  KL fine-tune of the local SAE within the same token budget).

Every dictionary leaves out the first ``--exclude-first-positions`` positions of each chunk (SmolLM2's attention
sinks, :class:`gradpatch.dictionaries.DictionaryConfig`) and starts its first step from ``b_dec`` = the mean of that
step's targets (``--b-dec-init mean``) or 0 (``keep``).

With ``--sparsify`` (eai-sparsify 1.3.3 from ``.peers/sparsify``, ``make peers PEERS=sparsify``;
``--sparsify-python`` names another virtualenv's Python), a fourth, ``sparsify-kl``: sparsify's own end-to-end
training (``loss_fn="kl"``, benchmarks/peers/sparsify/train_side.py) of the same initial SAE on the same chunks
in the same batches, at the end-to-end learning rate, without a schedule (the model saved as a ``from_pretrained``
folder for it; sparsify splices every position and sets b_dec to the first batch's mean on its first step).

Each is then spliced alone, without its error term, by :func:`gradpatch.dictionaries.evaluate_dictionary` on the
next ``--eval-tokens`` tokens of the corpus (held out), in batches of 4 chunks. Prints JSON: per run the metrics
(FVU, L0, CE original / spliced / zero-ablated, CE loss recovered, KL), ``ce_increase`` = CE spliced − CE original,
the training seconds; and each end-to-end run's CE increase over the local run's.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.dictionaries.end_to_end [--train-tokens N]
[--runs local,e2e,e2e+ds] [--sparsify]``; ``--random-weights --device cuda`` trains on a randomly initialised model of
SmolLM2-135M's shape instead (a timing check only: its CE numbers mean nothing).
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
import warnings
from typing import Any

import torch
from lightning.pytorch import Trainer
from torch.utils.data import DataLoader

from benchmarks.harness import emit
from gradpatch import PatchableGraph
from gradpatch.dictionaries import SparseAutoencoder, evaluate_dictionary
from gradpatch.files.loaders import load_embedded_model
from recipes.dictionary import (DictionaryModule, EndToEndDictionaryModule, downstream_residual_nodes, packed_chunks,
                                read_documents)


def random_smollm2_shaped(tokenizer: Any) -> torch.nn.Module:
    """A randomly initialised Llama of SmolLM2-135M's shape (hidden 576, intermediate 1536, 30 layers, 9 heads, 3 KV
    heads, vocabulary 49,152), seed 0."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
                         tie_word_embeddings=True)
    return LlamaForCausalLM(config).eval()


def train_sparsify_kl(args: argparse.Namespace, model: Any, sae: SparseAutoencoder, train: torch.Tensor,
                      scratch: str) -> SparseAutoencoder:
    """sparsify's end-to-end (KL) training of ``sae``'s initial weights on the chunks ``train`` ``[n, chunk]``, in its
    own virtualenv; the trained SAE read back with :func:`gradpatch.dictionaries.load_sparsify`, with ``sae``'s
    ``exclude_first_positions`` (so it is spliced as ours are)."""
    import dataclasses
    from pathlib import Path

    from safetensors.torch import save_file

    from benchmarks.dictionaries.sparsify_train import SIDE, save_sparsify_init
    from benchmarks.harness import peer_python, run_module_json, save_for_peers
    from gradpatch.dictionaries import load_sparsify

    work = Path(scratch) / "sparsify-kl"
    save_for_peers(model.cpu(), None, work / "model")
    model.to(args.device)
    save_file({"train": train.cpu().contiguous()}, str(work / "ids.safetensors"))
    save_sparsify_init(sae, work)
    run_module_json(peer_python("sparsify", args.sparsify_python), SIDE, [
        str(work), "--batch-size", str(args.batch_size), "--lr", str(args.e2e_lr or args.lr), "--device", args.device,
        "--loss-fn", "kl"])
    trained = load_sparsify(work / "sparsify" / "run" / "layers.12", node=args.node)
    trained.config = dataclasses.replace(trained.config, exclude_first_positions=sae.config.exclude_first_positions)
    return trained.to(args.device)


def train_phases(args: argparse.Namespace, pg: Any, sae: SparseAutoencoder, run: str, train: torch.Tensor,
                 downstream: list[str], scratch: str) -> int:
    """Train ``sae`` for ``run`` (``local``, ``e2e``, ``e2e+ds``, or ``local+e2e``: local for the first
    ``1 − --finetune-fraction`` of the steps, then KL) on the chunks ``train`` ``[steps · batch, chunk]`` in order;
    returns the optimizer steps taken."""
    phases = {"local": [("local", 1.0)], "e2e": [("e2e", 1.0)], "e2e+ds": [("e2e+ds", 1.0)],
              "local+e2e": [("local", 1 - args.finetune_fraction), ("e2e", 1.0)]}[run]
    steps, done = train.shape[0] // args.batch_size, 0
    for phase, share in phases:
        b_dec_init = args.b_dec_init if done == 0 else "keep"
        if phase == "local":  # the buffer holds one batch's rows: each step trains on that step's tokens
            module: DictionaryModule = DictionaryModule(
                pg, sae, buffer_rows=args.batch_size * (args.chunk - args.exclude_first_positions), lr=args.lr,
                ce_every_n_steps=0, density_every_n_steps=0, b_dec_init=b_dec_init)
        else:
            module = EndToEndDictionaryModule(pg, sae, lr=args.e2e_lr or args.lr, density_every_n_steps=0,
                                              downstream_nodes=downstream if phase == "e2e+ds" else (),
                                              downstream_coefficient=args.ds_coefficient if phase == "e2e+ds" else 0,
                                              b_dec_init=b_dec_init)
        trainer = Trainer(max_steps=round(steps * share) - done, max_epochs=1, devices=1, logger=False,
                          accelerator="gpu" if args.device.startswith("cuda") else "cpu", enable_checkpointing=False,
                          enable_progress_bar=False, enable_model_summary=False, default_root_dir=scratch)
        trainer.fit(module, DataLoader(train[done * args.batch_size:], batch_size=args.batch_size))
        done += trainer.global_step
    return done


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--node", default="model.layers_12.output")
    parser.add_argument("--latents", type=int, default=2304)
    parser.add_argument("--k", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--chunk", type=int, default=64, help="tokens per training row")
    parser.add_argument("--batch-size", type=int, default=4, help="chunks per step")
    parser.add_argument("--train-tokens", type=int, default=16384)
    parser.add_argument("--eval-tokens", type=int, default=2048)
    parser.add_argument("--ds-coefficient", type=float, default=5.0,
                        help="β_ds; Braun et al.'s GPT-2 configs weigh the downstream MSEs 2.5 against the KL's 0.5")
    parser.add_argument("--e2e-lr", type=float, default=None, help="the end-to-end runs' learning rate (default --lr)")
    parser.add_argument("--exclude-first-positions", type=int, default=2,
                        help="positions of each chunk left out of training and splicing (SmolLM2's attention sinks; "
                             "DictionaryConfig.exclude_first_positions); 0: every position")
    parser.add_argument("--runs", default="local,e2e,e2e+ds",
                        help="among local, e2e, e2e+ds and local+e2e (local, then KL for --finetune-fraction)")
    parser.add_argument("--b-dec-init", choices=["mean", "keep"], default="mean",
                        help="the modules' b_dec_init: the mean of the first step's targets, or 0 (kept)")
    parser.add_argument("--finetune-fraction", type=float, default=0.25,
                        help="local+e2e: the share of the steps trained end to end, after the local ones")
    parser.add_argument("--sparsify", action="store_true", help="adds the run sparsify-kl (module docstring)")
    parser.add_argument("--sparsify-python", default=None,
                        help="eai-sparsify's virtualenv Python (default: .peers/sparsify/bin/python); implies "
                             "--sparsify")
    parser.add_argument("--random-weights", action="store_true")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    args.sparsify = args.sparsify or args.sparsify_python is not None
    if args.sparsify and (args.node, args.latents, args.k) != ("model.layers_12.output", 2304, 32):
        parser.error("--sparsify trains sparsify's SAE at layers.12 with 2,304 latents and k = 32 (its side "
                     "script's): leave --node, --latents and --k at their defaults")
    warnings.filterwarnings("ignore")
    model, tokenizer = load_embedded_model()
    if args.random_weights:
        model = random_smollm2_shaped(tokenizer)
    model = model.to(args.device)
    train_chunks, eval_chunks = args.train_tokens // args.chunk, args.eval_tokens // args.chunk
    chunks = packed_chunks(tokenizer, read_documents(None), train_chunks + eval_chunks, args.chunk, 512)
    chunks = chunks.to(args.device)
    pg = PatchableGraph(model, chunks[:2], use_cache=False)
    width = model.config.hidden_size
    downstream = downstream_residual_nodes(pg, args.node)
    steps = train_chunks // args.batch_size
    report: dict[str, Any] = {}
    scratch = tempfile.mkdtemp(prefix="dictionaries_end_to_end_")
    runs = [run for run in args.runs.split(",") if run] + (["sparsify-kl"] if args.sparsify else [])
    for run in runs:
        sae = SparseAutoencoder(width, args.latents, "topk", k=args.k, node=args.node,
                                exclude_first_positions=args.exclude_first_positions,
                                generator=torch.Generator().manual_seed(0)).to(args.device)
        start = time.perf_counter()
        if run == "sparsify-kl":
            trained, done = train_sparsify_kl(args, model, sae, chunks[:steps * args.batch_size], scratch), steps
        else:
            trained, done = sae, train_phases(args, pg, sae, run, chunks[:steps * args.batch_size], downstream,
                                              scratch)
        seconds = time.perf_counter() - start
        batches = list(chunks[train_chunks:].split(4))
        metrics = evaluate_dictionary(pg, trained.eval(), batches).to_dict()
        metrics["ce_increase"] = metrics["ce_loss_spliced"] - metrics["ce_loss_original"]
        report[run] = {**metrics, "train_seconds": round(seconds, 1), "steps": done,
                       "trained_tokens": done * args.batch_size * args.chunk}
        print(json.dumps({run: report[run]}), flush=True)
    shutil.rmtree(scratch)
    ratios = {f"{run}_over_local": report[run]["ce_increase"] / report["local"]["ce_increase"]
              for run in report if run != "local" and "local" in report}
    emit({"model": "random SmolLM2-135M-shaped" if args.random_weights else "SmolLM2-135M-Instruct",
          "device": args.device, "node": args.node, "latents": args.latents, "k": args.k, "lr": args.lr,
          "e2e_lr": args.e2e_lr or args.lr, "finetune_fraction": args.finetune_fraction, "b_dec_init": args.b_dec_init,
          "exclude_first_positions": args.exclude_first_positions, "chunk": args.chunk, "batch_size": args.batch_size,
          "train_tokens": train_chunks * args.chunk, "eval_tokens": eval_chunks * args.chunk,
          "ds_coefficient": args.ds_coefficient, "downstream_nodes": [downstream[0], downstream[-1], len(downstream)],
          "runs": report, "ce_increase_ratios": ratios}, device=args.device)


if __name__ == "__main__":
    main()
