"""End-to-end against local training of a TopK SAE on SmolLM2-135M-Instruct: same node, k, width, initial weights,
tokens and token order (Braun et al. 2024, arXiv 2405.12241, Table 1: e2e SAEs lose far less CE at equal L0).

Three SAEs at ``--node`` (default ``model.layers_12.output``, the residual stream after layer 12 of 30), ``--latents``
latents, k = ``--k``, all starting from the same weights (seed 0), each trained by Adam (``--lr``) on the same packed
chunks of the offline Wikipedia summaries (:func:`recipes.dictionary.read_documents`, ``--chunk`` tokens each,
``--batch-size`` chunks per step, one pass over ``--train-tokens``):

- ``local``: :class:`recipes.dictionary.DictionaryModule` (FVU + AuxK/32, unit-norm decoder), its buffer one batch
  long, so each step trains on exactly that step's tokens (in shuffled row order), as the end-to-end runs do;
- ``e2e``: :class:`recipes.dictionary.EndToEndDictionaryModule`, KL(original ‖ spliced);
- ``e2e+ds``: the same plus β_ds (``--ds-coefficient``) times the mean MSE over the downstream residual nodes
  (:func:`recipes.dictionary.downstream_residual_nodes`: layers 13 .. 28's outputs).

Each is then spliced alone, without its error term, by :func:`gradpatch.dictionaries.evaluate_dictionary` on the
next ``--eval-tokens`` tokens of the corpus (held out), in batches of 4 chunks. Prints JSON: per run the metrics
(FVU, L0, CE original / spliced / zero-ablated, CE loss recovered, KL), ``ce_increase`` = CE spliced − CE original,
the training seconds; and each end-to-end run's CE increase over the local run's.

Run: ``PYTHONPATH=$PWD OMP_NUM_THREADS=1 .venv/bin/python benchmarks/dictionaries_end_to_end.py [--train-tokens
N] [--runs local,e2e,e2e+ds]``; ``--random-weights --device cuda`` trains on a randomly initialised model of
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
    parser.add_argument("--runs", default="local,e2e,e2e+ds")
    parser.add_argument("--random-weights", action="store_true")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
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
    for run in args.runs.split(","):
        sae = SparseAutoencoder(width, args.latents, "topk", k=args.k, node=args.node,
                                generator=torch.Generator().manual_seed(0)).to(args.device)
        if run == "local":
            module: DictionaryModule = DictionaryModule(pg, sae, buffer_rows=args.batch_size * args.chunk, lr=args.lr,
                                                        ce_every_n_steps=0, density_every_n_steps=0)
        else:
            module = EndToEndDictionaryModule(pg, sae, lr=args.lr, density_every_n_steps=0,
                                              downstream_nodes=downstream if run == "e2e+ds" else (),
                                              downstream_coefficient=args.ds_coefficient if run == "e2e+ds" else 0)
        trainer = Trainer(max_steps=steps, max_epochs=1, accelerator="gpu" if args.device.startswith("cuda") else "cpu",
                          devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                          enable_model_summary=False, default_root_dir=scratch)
        start = time.perf_counter()
        trainer.fit(module, DataLoader(chunks[:train_chunks], batch_size=args.batch_size))
        seconds = time.perf_counter() - start
        batches = list(chunks[train_chunks:].split(4))
        metrics = evaluate_dictionary(pg, sae.eval(), batches).to_dict()
        metrics["ce_increase"] = metrics["ce_loss_spliced"] - metrics["ce_loss_original"]
        report[run] = {**metrics, "train_seconds": round(seconds, 1), "steps": trainer.global_step,
                       "trained_tokens": trainer.global_step * args.batch_size * args.chunk}
        print(json.dumps({run: report[run]}), flush=True)
    shutil.rmtree(scratch)
    ratios = {f"{run}_over_local": report[run]["ce_increase"] / report["local"]["ce_increase"]
              for run in report if run != "local" and "local" in report}
    print(json.dumps({"model": "random SmolLM2-135M-shaped" if args.random_weights else "SmolLM2-135M-Instruct",
                      "device": args.device, "node": args.node, "latents": args.latents, "k": args.k, "lr": args.lr,
                      "chunk": args.chunk, "batch_size": args.batch_size, "train_tokens": train_chunks * args.chunk,
                      "eval_tokens": eval_chunks * args.chunk, "ds_coefficient": args.ds_coefficient,
                      "downstream_nodes": [downstream[0], downstream[-1], len(downstream)], "runs": report,
                      "ce_increase_ratios": ratios}, indent=2))


if __name__ == "__main__":
    main()
