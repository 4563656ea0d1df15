"""Training a TopK SAE against EleutherAI's sparsify: held-out FVU, training tokens/s and peak memory, same
activations, initial weights, hyper-parameters and token order on both sides.

The SAE reads SmolLM2-135M-Instruct's residual stream after layer 12 (our ``model.layers_12.output``, sparsify's
hookpoint ``layers.12``): 4 × 576 = 2,304 latents, k = 32, Adam at sparsify's learning rate for that width
(2e-4 / sqrt(2304 / 2^14) = 5.33e-4), FVU loss, unit-norm decoder rows (parallel gradient removed), AuxK α = 1/32
over latents dead for 10M tokens (none can be within the budgets run here).

1. ``prepare`` (this process): the model saved as a ``from_pretrained`` folder (both sides load it); the token ids
   (packed chunks of the Wikipedia summaries our ``DictionaryDataModule`` reads, the first ``--eval-tokens`` held
   out; or, with ``--random-weights``, a SmolLM2-135M-shaped Llama with random weights and random ids) written to
   ``ids.safetensors``; our initial SAE (unit-norm decoder rows, encoder = decoder transpose, b_enc = 0) with b_dec
   set to the mean activation of the first batch, as sparsify sets it on its first step, written in our layout and
   in sparsify's parameter names.
2. ``ours`` (a subprocess in this virtualenv): :class:`recipes.dictionary.DictionaryModule` through a Lightning
   ``Trainer`` (one epoch, Lightning's default TensorBoard logger) on a ``DataLoader`` of the training chunks in
   order; its shuffle buffer holds exactly one batch (``buffer_rows = batch × chunk``), so each optimizer step sees
   the same tokens as sparsify's (in another order within the step, which a full-batch gradient does not see).
3. ``benchmarks/peers/sparsify/train_side.py`` (a subprocess in sparsify's virtualenv): sparsify's
   ``Trainer`` (``loss_fn="fvu"``) on the same chunks and initial weights.
4. Both results scored here by the same code on the held-out chunks: FVU Σ‖x − x̂‖² / Σ‖x − mean(x)‖² (float64
   sums), L0 and the fraction of latents unfired on them; sparsify's SAE read with
   :func:`gradpatch.dictionaries.load_sparsify`.

Each side reports the wall time of its ``fit`` (model forwards included), the resident memory once the model is
loaded and the peak during ``fit`` (``VmHWM`` reset before it, benchmarks/harness.py) and the process's
``getrusage`` maxrss. The sides run one after the other, never together.

Run (CPU): ``OMP_NUM_THREADS=2 .venv/bin/python -m benchmarks.dictionaries.sparsify_train --tokens 1048576``
(sparsify from ``.peers/sparsify``, ``make peers PEERS=sparsify``; ``--python`` names another); on a GPU without the
GGUF: ``--random-weights --device cuda``. Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from benchmarks.harness import (cuda_peak_mib, emit, max_rss_mib, peak_mib, peer_python, reset_peak, resident_mib,
                                run_module_json)

NODE, HOOKPOINT = "model.layers_12.output", "layers.12"
EXPANSION, K = 4, 32
#: sparsify's side (benchmarks/peers/sparsify/train_side.py), run under its virtualenv's Python.
SIDE = "benchmarks.peers.sparsify.train_side"


def sparsify_lr(d_sae: int) -> float:
    """sparsify's Adam learning rate for ``d_sae`` latents when none is given (its trainer: 2e-4 / sqrt(m / 2^14))."""
    return 2e-4 / (d_sae / 2 ** 14) ** 0.5


def random_smollm2(seed: int) -> Any:
    """A LlamaForCausalLM shaped as SmolLM2-135M (hidden 576, MLP 1536, 30 layers, 9 heads, 3 KV heads, vocabulary
    49,152, tied embeddings), randomly initialised from ``seed``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True,
                         max_position_embeddings=8192,
                         rms_norm_eps=1e-5, rope_theta=100000.0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


def graph_of(model: Any) -> Any:
    """The PatchableGraph of ``model``, extracted on a ``[2, 8]`` batch of ids (no tokenizer needed; any batch size
    and length runs on it). A short example, as ``editable_graph``'s prompts: extracting on ``[2, 128]`` left the
    process 200 MB larger."""
    from gradpatch import PatchableGraph

    example = torch.ones(2, 8, dtype=torch.long, device=next(model.parameters()).device)
    with torch.no_grad():
        return PatchableGraph(model, example, use_cache=False).eval()


def save_sparsify_init(sae: Any, work: Path) -> None:
    """``sae``'s weights in sparsify's parameter names, ``work/init_sparsify.safetensors`` (what the side script loads
    into its ``SparseCoder`` before training)."""
    save_file({"encoder.weight": sae.W_enc.detach().T.contiguous().cpu(), "encoder.bias": sae.b_enc.detach().cpu(),
               "W_dec": sae.W_dec.detach().cpu().contiguous(), "b_dec": sae.b_dec.detach().cpu().contiguous()},
              str(work / "init_sparsify.safetensors"))


def prepare(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Step 1 (module docstring): ``work/model``, ``work/ids.safetensors``, ``work/init`` and
    ``work/init_sparsify.safetensors``; returns what was prepared."""
    from benchmarks.harness import save_for_peers
    from gradpatch.capture import node_activations
    from gradpatch.dictionaries import SparseAutoencoder, save_dictionary

    n_train, n_eval = args.tokens // args.chunk, args.eval_tokens // args.chunk
    n_train -= n_train % args.batch_size
    if args.random_weights:
        model = random_smollm2(args.seed)
        ids = torch.randint(0, model.config.vocab_size, (n_eval + n_train, args.chunk),
                            generator=torch.Generator().manual_seed(args.seed))
        source = f"random SmolLM2-135M-shaped Llama (seed {args.seed}), uniform random ids"
    else:
        from gradpatch.files.loaders import load_embedded_model
        from recipes.dictionary.corpus import packed_chunks, read_documents

        model, tokenizer = load_embedded_model()
        ids = packed_chunks(tokenizer, read_documents(None), n_eval + n_train, args.chunk, args.max_length)
        if ids.shape[0] < n_eval + n_train:
            raise SystemExit(f"the corpus gives {ids.shape[0]} chunks of {args.chunk}, fewer than the "
                             f"{n_eval + n_train} asked for")
        source = "SmolLM2-135M-Instruct (embedded GGUF), Wikipedia summaries"
    save_for_peers(model, None, work / "model")
    save_file({"train": ids[n_eval:].contiguous(), "eval": ids[:n_eval].contiguous()}, str(work / "ids.safetensors"))
    d_in = model.config.hidden_size
    sae = SparseAutoencoder(d_in, EXPANSION * d_in, "topk", K, node=NODE,
                            generator=torch.Generator().manual_seed(args.seed))
    first = node_activations(graph_of(model), [NODE], ids[n_eval:n_eval + args.batch_size])[0]
    with torch.no_grad():
        sae.b_dec.copy_(first.reshape(-1, d_in).float().mean(0))
    save_dictionary(sae, work / "init")
    save_sparsify_init(sae, work)
    return {"source": source, "train_tokens": n_train * args.chunk, "eval_tokens": n_eval * args.chunk,
            "d_in": d_in, "d_sae": EXPANSION * d_in}


def train_ours(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Step 2 (module docstring), in its own process: the trained SAE in ``work/ours/dictionary``."""
    from lightning.pytorch import Trainer
    from torch.utils.data import DataLoader
    from transformers import AutoModelForCausalLM

    from gradpatch.dictionaries import load_dictionary
    from recipes.dictionary import DictionaryModule

    if args.device == "cuda":
        torch.set_float32_matmul_precision("high")  # as sparsify's fit does (TF32 matmuls)
    train = load_file(str(work / "ids.safetensors"))["train"]
    model = AutoModelForCausalLM.from_pretrained(str(work / "model"), dtype=getattr(torch, args.dtype))
    model.to(args.device).eval()
    pg = graph_of(model)
    sae = load_dictionary(work / "init")
    module = DictionaryModule(pg, sae, buffer_rows=args.batch_size * args.chunk, lr=sparsify_lr(sae.d_sae),
                              seed=args.seed, b_dec_init="keep")  # b_dec set in prepare, as sparsify sets it
    trainer = Trainer(max_epochs=1, accelerator="gpu" if args.device == "cuda" else "cpu", devices=1,
                      default_root_dir=str(work / "ours"), enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False)
    loaded = resident_mib()
    reset_peak()
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    start, cpu = time.perf_counter(), time.process_time()
    trainer.fit(module, DataLoader(train, batch_size=args.batch_size))
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    return {"seconds": seconds, "tokens": int(train.numel()), "tokens_per_s": train.numel() / seconds,
            "cpu_seconds": cpu, "tokens_per_cpu_s": train.numel() / cpu,
            "optimizer_steps": int(trainer.global_step), "resident_after_load_mib": loaded,
            "peak_during_fit_mib": peak_mib(), "maxrss_mib": max_rss_mib(),
            "cuda_peak_allocated_mib": cuda_peak_mib(args.device)}


def score(args: argparse.Namespace, work: Path, dictionaries: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Step 4 (module docstring): FVU, L0 and unfired fraction of each dictionary on the held-out chunks."""
    from transformers import AutoModelForCausalLM

    from gradpatch.capture import node_activations

    held_out = load_file(str(work / "ids.safetensors"))["eval"]
    model = AutoModelForCausalLM.from_pretrained(str(work / "model"), dtype=getattr(torch, args.dtype))
    pg = graph_of(model.to(args.device).eval())
    sums = {name: {"error": 0.0, "active": 0.0, "fired": torch.zeros(d.d_sae, dtype=torch.bool)}
            for name, d in dictionaries.items()}
    xs = []
    for batch in held_out.split(args.batch_size):
        x = node_activations(pg, [NODE], batch.to(args.device))[0].flatten(0, 1).float()
        xs.append(x.double().cpu())
        for name, dictionary in dictionaries.items():
            with torch.no_grad():
                z = dictionary.to(args.device).eval().encode(x)
                error = (dictionary.decode(z) - x).double().pow(2).sum()
            sums[name]["error"] += float(error)
            sums[name]["active"] += float((z > 0).sum())
            sums[name]["fired"] |= (z > 0).any(0).cpu()
    x = torch.cat(xs)
    variance = float((x - x.mean(0)).pow(2).sum())
    return {name: {"fvu": s["error"] / variance, "l0": s["active"] / x.shape[0],
                   "unfired_fraction": 1 - float(s["fired"].float().mean())} for name, s in sums.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", help="the Python of sparsify's virtualenv (default: .peers/sparsify/bin/python)")
    parser.add_argument("--tokens", type=int, default=1 << 20, help="training tokens (whole batches)")
    parser.add_argument("--eval-tokens", type=int, default=16384, help="held-out tokens scored")
    parser.add_argument("--chunk", type=int, default=128, help="tokens per sequence (chunk)")
    parser.add_argument("--batch-size", type=int, default=16, help="sequences per optimizer step (sparsify's unit)")
    parser.add_argument("--max-length", type=int, default=256, help="tokens per document at most (corpus)")
    parser.add_argument("--schedule", choices=["constant", "sparsify"], default="constant",
                        help="sparsify's learning rate: constant as ours, or its own warmup + linear decay")
    parser.add_argument("--warmup", type=int, default=1000, help="sparsify's lr_warmup_steps (--schedule sparsify)")
    parser.add_argument("--random-weights", action="store_true", help="a random SmolLM2-shaped model, random ids")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="the model's dtype")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sides", default="ours,sparsify", help="which sides to train, in order")
    parser.add_argument("--work", default=None, help="working folder (default: a temporary one)")
    parser.add_argument("--step", choices=["all", "ours"], default="all", help=argparse.SUPPRESS)
    args = parser.parse_args()
    sides = args.sides.split(",")
    if not set(sides) <= {"ours", "sparsify"}:
        parser.error(f"--sides takes ours and/or sparsify, comma-separated, not {args.sides!r}")
    if args.step == "ours":
        emit(train_ours(args, Path(args.work)), device=args.device, indent=None)
        return
    with tempfile.TemporaryDirectory() as scratch:
        work = Path(args.work or scratch)
        prepared = prepare(args, work)
        lr = sparsify_lr(prepared["d_sae"])
        report: dict[str, Any] = {"prepared": prepared, "device": args.device, "dtype": args.dtype,
                                  "batch": f"{args.batch_size} x {args.chunk} tokens", "lr": lr,
                                  "sparsify_schedule": args.schedule}
        dictionaries: dict[str, Any] = {}
        from gradpatch.dictionaries import load_dictionary, load_sparsify

        dictionaries["initial"] = load_dictionary(work / "init")
        for side in sides:
            if side == "ours":
                report["ours"] = run_module_json(sys.executable, "benchmarks.dictionaries.sparsify_train",
                                                 [*sys.argv[1:], "--work", str(work), "--step", "ours"])
                dictionaries["ours"] = load_dictionary(work / "ours" / "dictionary", check_fingerprint=False)
            else:
                report["sparsify"] = run_module_json(peer_python("sparsify", args.python), SIDE, [
                    str(work), "--batch-size", str(args.batch_size), "--lr", str(lr), "--device", args.device,
                    "--dtype", args.dtype, "--schedule", args.schedule, "--warmup", str(args.warmup)])
                dictionaries["sparsify"] = load_sparsify(work / "sparsify" / "run" / HOOKPOINT, node=NODE)
            print(json.dumps({side: report[side]}), file=sys.stderr, flush=True)  # kept if a later step fails
        report["held_out"] = score(args, work, dictionaries)
        emit(report, device=args.device)


if __name__ == "__main__":
    main()
