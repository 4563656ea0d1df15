"""A skip transcoder against a plain transcoder at one MLP of SmolLM2-135M-Instruct, same width, k and tokens.

Both read ``model.layers_<L>.mlp.x`` (the MLP's input, after ``post_attention_layernorm``) and predict
``model.layers_<L>.mlp.output``; TopK, ``--latents`` latents, k = ``--k``, trained by
:class:`recipes.dictionary.DictionaryModule` (Adam, ``--lr``, AuxK, unit-norm decoder rows) on the same packed
chunks of 128 tokens of the offline Wikipedia summaries (:func:`editors.statistics.wiki_summaries`, seed 0) in the
same order (``--train-tokens``), then scored by :func:`gradpatch.dictionaries.evaluate_dictionary` on the next
``--eval-tokens`` tokens (spliced alone, without the error term). Float32 on the CPU.

Prints JSON: per kind, FVU, CE loss recovered (original, spliced, zero-ablated CE), L0, dead fraction, KL, and the
training seconds.

Run: ``PYTHONPATH=$PWD OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.dictionaries.skip_transcoder [--layer 0]
[--train-tokens 409600]``.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
import warnings

import torch
from lightning.pytorch import Trainer
from torch.utils.data import DataLoader

from benchmarks.harness import emit
from editors.statistics import wiki_summaries
from gradpatch import PatchableGraph
from gradpatch.dictionaries import SkipTranscoder, Transcoder, evaluate_dictionary
from gradpatch.files.loaders import load_embedded_model
from recipes.dictionary import DictionaryModule

CHUNK = 128


def token_chunks(tokenizer: object, count: int) -> torch.Tensor:
    """The first ``count`` chunks ``[count, 128]`` of the corpus's documents tokenized and concatenated."""
    ids: list[int] = []
    for text in wiki_summaries():
        ids.extend(tokenizer(text, add_special_tokens=False)["input_ids"])  # type: ignore[operator]
        if len(ids) >= count * CHUNK:
            break
    return torch.tensor(ids[:count * CHUNK]).reshape(count, CHUNK)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layer", type=int, default=0,
                        help="zeroing layer 0's MLP output raises the CE from 3.42 to 12.78 (512 tokens); those of "
                             "layers 1, 2, 3, 6, 9, 12, 15, 20, 25 by at most 1.2, layer 29's by 2.1")
    parser.add_argument("--latents", type=int, default=2304)
    parser.add_argument("--k", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--batch-size", type=int, default=8, help="chunks of 128 tokens per step")
    parser.add_argument("--train-tokens", type=int, default=409600)
    parser.add_argument("--eval-tokens", type=int, default=4096)
    parser.add_argument("--b-dec-init", choices=["mean", "keep"], default="mean",
                        help="DictionaryModule's b_dec_init (the docs' table: keep, the only behaviour then)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    model, tokenizer = load_embedded_model()
    train_chunks, eval_chunks = args.train_tokens // CHUNK, args.eval_tokens // CHUNK
    chunks = token_chunks(tokenizer, train_chunks + eval_chunks)
    pg = PatchableGraph(model, chunks[:2], use_cache=False)
    read, write = f"model.layers_{args.layer}.mlp.x", f"model.layers_{args.layer}.mlp.output"
    width = model.config.hidden_size
    report = {}
    scratch = tempfile.mkdtemp(prefix="dictionaries_skip_transcoder_")
    for kind in (Transcoder, SkipTranscoder):
        dictionary = kind(width, args.latents, activation="topk", k=args.k, input_node=read, output_node=write,
                          generator=torch.Generator().manual_seed(0))
        fill = 8  # batches in the buffer: the first update comes with the 8th batch
        module = DictionaryModule(pg, dictionary, buffer_rows=fill * args.batch_size * CHUNK, lr=args.lr,
                                  b_dec_init=args.b_dec_init)
        trainer = Trainer(max_steps=train_chunks // args.batch_size, max_epochs=1, accelerator="cpu", logger=False,
                          enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                          default_root_dir=scratch)  # where DictionaryModule writes the dictionary at the end
        start = time.perf_counter()
        trainer.fit(module, DataLoader(chunks[:train_chunks], batch_size=args.batch_size))
        seconds = time.perf_counter() - start
        batches = list(chunks[train_chunks:].split(4))
        metrics = evaluate_dictionary(pg, dictionary.eval(), batches).to_dict()
        updates = trainer.global_step - (fill - 1)
        report[type(dictionary).__name__] = {**metrics, "train_seconds": round(seconds, 1), "updates": updates,
                                            "trained_tokens": updates * args.batch_size * CHUNK}
    shutil.rmtree(scratch)
    emit({"layer": args.layer, "read": read, "write": write, "latents": args.latents, "k": args.k,
                      "lr": args.lr, "train_tokens": train_chunks * CHUNK, "eval_tokens": eval_chunks * CHUNK,
                      "dictionaries": report})


if __name__ == "__main__":
    main()
