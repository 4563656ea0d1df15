"""Skip transcoders at SmolLM2's MLPs trained by our recipe and by EleutherAI's sparsify on the same tokens, scored
side by side on held-out text by the same code.

Both sides train one skip transcoder (x̂ = TopK latents W_dec + b_dec + x W_skipᵀ; Paulo et al. 2025, arXiv
2501.18823) per layer of ``--layers`` at the MLP (input -> output; our ``model.layers_{l}.mlp.x`` ->
``model.layers_{l}.mlp.output``, sparsify's hookpoint ``layers.{l}.mlp``) with the same latents
(``--expansion`` × 576), the same ``k``, the same chunks in the same order, ``--batch-size`` chunks per optimizer step,
Adam at ``--lr``, AuxK α = 1/32 over latents dead for ``--dead-after`` tokens, and positions 0 and 1 of every chunk
(SmolLM2's attention sinks) left out on both sides.

1. ``prepare`` (this process): the model saved as a ``from_pretrained`` folder (both sides load it); the recipe's
   text split (:class:`recipes.dictionary.DictionaryDataModule`): the corpus's first documents, ``--eval-tokens`` of
   them, held out (one document per forward pass when scored), the chunks packed from the documents after them.
2. ``ours`` (a subprocess in this virtualenv): :class:`recipes.dictionary.DictionaryModule` through a Lightning
   ``Trainer``, one epoch, with the recipe's settings (``recipes/configs/transcoders_smollm2.yaml``): unit-norm
   decoder rows, ``--skip-init`` (``least_squares``: W_skip and b_dec fitted on the first step's and the shuffle
   buffer's rows), ``--buffer-rows``, linear warm-up over ``--warmup`` steps, linear decay to 0 over the last
   ``--decay`` of them.
3. ``benchmarks/peers/sparsify/train_side.py --transcode --skip`` (a subprocess in sparsify's virtualenv): sparsify's
   ``Trainer`` with its own transcoder initialisation (W_dec and W_skip 0, no decoder normalisation for
   transcoders, the encoder bias centring the inputs, b_dec the first batch's output mean) and its own schedule
   (linear warm-up over ``--warmup`` steps, then linear decay to 0 over the run).
4. Both scored here by :func:`gradpatch.dictionaries.evaluate_layers` on the held-out documents: per layer FVU, L0,
   dead fraction (latents unfired on them) and CE loss recovered with that layer's transcoder spliced alone, and the
   CE loss recovered with the listed layers spliced at once; sparsify's read with
   :func:`gradpatch.dictionaries.load_sparsify` and scored at the same positions (from position 2).

Run (CPU): ``OMP_NUM_THREADS=2 .venv/bin/python -m benchmarks.dictionaries.sparsify_transcoders --tokens 16384
--layers 3 12 24`` (sparsify from ``.peers/sparsify``). Prints JSON: each side's wall time and steps, and
``held_out``: both sides' figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from benchmarks.dictionaries.sparsify_train import graph_of
from benchmarks.harness import emit, peer_python, run_module_json

EXCLUDED = 2
SIDE = "benchmarks.peers.sparsify.train_side"


def prepare(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Step 1 (module docstring): ``work/model`` and ``work/ids.safetensors``."""
    from benchmarks.harness import save_for_peers
    from gradpatch.files.loaders import load_embedded_model
    from recipes.dictionary.corpus import packed_chunks, read_documents, tokenize_documents

    model, tokenizer = load_embedded_model()
    documents = read_documents(None)
    held_out, read = tokenize_documents(tokenizer, documents, args.eval_tokens, args.max_length)
    n_train = args.tokens // args.chunk
    n_train -= n_train % args.batch_size
    chunks = packed_chunks(tokenizer, documents[read:], n_train, args.chunk, args.max_length)
    save_for_peers(model, None, work / "model")
    save_file({"train": chunks.contiguous(), **{f"eval_{i}": torch.tensor(ids) for i, ids in enumerate(held_out)}},
              str(work / "ids.safetensors"))
    return {"source": "SmolLM2-135M-Instruct (embedded GGUF), Wikipedia summaries", "train_tokens": int(chunks.numel()),
            "eval_tokens": sum(map(len, held_out)), "eval_documents": len(held_out),
            "d_sae": args.expansion * int(model.config.hidden_size)}


def load_pg(args: argparse.Namespace, work: Path) -> Any:
    """The saved model's PatchableGraph (float32, CPU)."""
    from transformers import AutoModelForCausalLM

    return graph_of(AutoModelForCausalLM.from_pretrained(str(work / "model"), dtype=torch.float32).eval())


def train_ours(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Step 2 (module docstring), in its own process: the transcoders in ``work/ours/dictionary/<node>``."""
    from lightning.pytorch import Trainer
    from torch.utils.data import DataLoader

    from recipes.dictionary import DictionaryModule, DictionarySpec, build_dictionaries

    train = load_file(str(work / "ids.safetensors"))["train"]
    pg = load_pg(args, work)
    spec = DictionarySpec(node="mlp_input", kind="skip_transcoder", output_node="mlp", layers=list(args.layers),
                          k=args.k, expansion_factor=args.expansion, exclude_first_positions=EXCLUDED)
    module = DictionaryModule(pg, build_dictionaries(pg, spec, args.seed), buffer_rows=args.buffer_rows, lr=args.lr,
                              dead_after_tokens=args.dead_after, seed=args.seed, density_every_n_steps=0,
                              ce_every_n_steps=0, b_dec_init="mean", lr_warmup_steps=args.warmup,
                              lr_decay_fraction=args.decay, skip_init=args.skip_init)
    trainer = Trainer(max_epochs=1, accelerator="cpu", devices=1, default_root_dir=str(work / "ours"), logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    start = time.perf_counter()
    trainer.fit(module, DataLoader(train, batch_size=args.batch_size))
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "tokens": int(train.numel()), "optimizer_steps": int(trainer.global_step)}


def score(args: argparse.Namespace, work: Path, sides: dict[str, list[Any]]) -> dict[str, Any]:
    """Step 4 (module docstring): each side's per-layer and all-spliced figures on the held-out documents."""
    from gradpatch.dictionaries import evaluate_layers, per_layer_dictionaries

    ids = load_file(str(work / "ids.safetensors"))
    documents = [ids[f"eval_{i}"][None] for i in range(sum(name.startswith("eval_") for name in ids))]
    pg = load_pg(args, work)
    report: dict[str, Any] = {}
    for side, dictionaries in sides.items():
        layers = dataclasses.replace(per_layer_dictionaries(dictionaries), exclude_first_positions=EXCLUDED)
        scores = evaluate_layers(pg, layers, documents)
        report[side] = {
            "layers": {str(layer): {"fvu": m.fvu, "l0": m.l0, "dead_fraction": m.dead_fraction,
                                    "ce_loss_recovered": m.ce_loss_recovered}
                       for layer, m in zip(args.layers, scores.layers.values())},
            "listed_layers_spliced_at_once": scores.all_spliced.to_dict()}
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", help="the Python of sparsify's virtualenv (default: .peers/sparsify/bin/python)")
    parser.add_argument("--layers", type=int, nargs="+", default=[3, 12, 24])
    parser.add_argument("--tokens", type=int, default=16384, help="training tokens (whole batches)")
    parser.add_argument("--eval-tokens", type=int, default=1024, help="held-out tokens scored (the first documents)")
    parser.add_argument("--chunk", type=int, default=128, help="tokens per sequence (chunk)")
    parser.add_argument("--max-length", type=int, default=128, help="tokens per document at most (corpus)")
    parser.add_argument("--batch-size", type=int, default=2, help="chunks per optimizer step")
    parser.add_argument("--expansion", type=int, default=2)
    parser.add_argument("--k", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.002, help="Adam's learning rate, both sides")
    parser.add_argument("--warmup", type=int, default=6, help="warm-up steps, both sides")
    parser.add_argument("--decay", type=float, default=0.2, help="ours: the last fraction of steps decayed to 0")
    parser.add_argument("--dead-after", type=int, default=10000, help="tokens unfired before a latent is dead")
    parser.add_argument("--buffer-rows", type=int, default=4096, help="ours: the shuffle buffer's rows")
    parser.add_argument("--skip-init", choices=["zero", "least_squares"], default="least_squares")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sides", default="ours,sparsify", help="which sides to train, in order")
    parser.add_argument("--work", default=None, help="working folder (default: a temporary one)")
    parser.add_argument("--step", choices=["all", "ours"], default="all", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.step == "ours":
        emit(train_ours(args, Path(args.work)), indent=None)
        return
    with tempfile.TemporaryDirectory() as scratch:
        work = Path(args.work or scratch)
        work.mkdir(parents=True, exist_ok=True)
        report: dict[str, Any] = {"prepared": prepare(args, work), "layers": args.layers, "k": args.k,
                                  "batch": f"{args.batch_size} x {args.chunk} tokens", "lr": args.lr,
                                  "warmup_steps": args.warmup, "ours_decay_fraction": args.decay,
                                  "ours_skip_init": args.skip_init, "ours_buffer_rows": args.buffer_rows}
        from gradpatch.dictionaries import load_dictionary, load_sparsify

        nodes = [(f"model.layers_{layer}.mlp.x", f"model.layers_{layer}.mlp.output") for layer in args.layers]
        sides: dict[str, list[Any]] = {}
        for side in args.sides.split(","):
            if side == "ours":
                report["ours"] = run_module_json(sys.executable, "benchmarks.dictionaries.sparsify_transcoders",
                                                 [*sys.argv[1:], "--work", str(work), "--step", "ours"])
                sides["ours"] = [load_dictionary(work / "ours" / "dictionary" / write, check_fingerprint=False)
                                 for _, write in nodes]
            else:
                hookpoints = [f"layers.{layer}.mlp" for layer in args.layers]
                report["sparsify"] = run_module_json(peer_python("sparsify", args.python), SIDE, [
                    str(work), "--batch-size", str(args.batch_size), "--lr", str(args.lr), "--schedule", "sparsify",
                    "--warmup", str(args.warmup), "--transcode", "--skip", "--no-init", "--hookpoints", *hookpoints,
                    "--expansion", str(args.expansion), "--k", str(args.k), "--dead-after", str(args.dead_after),
                    "--exclude-first", str(EXCLUDED)])
                sides["sparsify"] = [load_sparsify(work / "sparsify" / "run" / point, node=read, output_node=write)
                                     for point, (read, write) in zip(hookpoints, nodes)]
            print(json.dumps({side: report[side]}), file=sys.stderr, flush=True)  # kept if a later step fails
        report["held_out"] = score(args, work, sides)
        emit(report)


if __name__ == "__main__":
    main()
