"""sparsify's side of benchmarks/dictionaries/sparsify_train.py, run in sparsify's own virtualenv (no gradpatch).

``WORK`` holds what the driver prepared: ``model/`` (a ``from_pretrained`` folder, loaded with ``AutoModel`` as
sparsify's command line loads a model for ``loss_fn="fvu"``), ``ids.safetensors`` (``train`` ``[n, chunk]``) and
``init_sparsify.safetensors`` (the initial SAE in sparsify's parameter names). sparsify's ``Trainer`` trains a TopK
``SparseCoder`` (expansion 4, k = 32) at hookpoint ``layers.12`` on the chunks in order (``batch_size`` sequences a
step, no shuffling, as its trainer reads a dataset), with

- Adam from torch: bitsandbytes, whose 8-bit Adam sparsify prefers when it is importable, is hidden, so that both
  sides run the same optimizer;
- ``--schedule constant``: sparsify's warmup + linear decay schedule removed (ours has none); ``sparsify``: kept,
  with ``--warmup`` steps;
- ``--loss-fn``: ``fvu`` (local, the default) or sparsify's end-to-end ``kl`` (the model then loaded with
  ``AutoModelForCausalLM``, as its command line does; benchmarks/dictionaries/end_to_end.py's ``--sparsify-python``);
- AuxK α = 1/32 over latents dead for ``--dead-after`` tokens (10M by default; sparsify's default α is 0; ours is
  1/32), no wandb, one save at the end to ``WORK/sparsify/run/<hookpoint>``;
- ``--transcode --skip`` (benchmarks/dictionaries/sparsify_transcoders.py): skip transcoders at the ``--hookpoints``
  (MLP modules, ``layers.3.mlp``: sparsify's hook reads the module's input and output), sparsify's own
  initialisation (``--init`` off: W_dec and W_skip 0, the encoder bias centring the inputs, b_dec the outputs'
  mean), ``--expansion`` and ``--k``; ``--exclude-first N``: the first N positions of every sequence left out of
  training, as gradpatch's ``exclude_first_positions`` leaves them out (sparsify masks tokens by id only,
  ``exclude_tokens``: its ``torch.isin`` mask is narrowed here, in this process only).

Prints one JSON object (under :func:`benchmarks.harness.emit`'s header): the wall time of ``Trainer.fit`` (model
forwards included), tokens/s, the resident memory once the model is loaded, the peak during ``fit`` (``VmHWM`` reset
before it) and the process's ``getrusage`` maxrss (MiB).

Run: ``.peers/sparsify/bin/python -m benchmarks.peers.sparsify.train_side WORK --batch-size 16 --lr 5.33e-4``
(from the repository's root).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.modules["bitsandbytes"] = None  # type: ignore[assignment]  # torch's Adam on both sides (module docstring)
os.environ.setdefault("TQDM_DISABLE", "1")

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from sparsify import SaeConfig, TrainConfig, Trainer  # noqa: E402
from transformers import AutoModel, AutoModelForCausalLM  # noqa: E402

from benchmarks.harness import cuda_peak_mib, emit, max_rss_mib, peak_mib, reset_peak, resident_mib  # noqa: E402

HOOKPOINT = "layers.12"


def narrow_token_mask(first: int) -> None:
    """Leave the first ``first`` positions of every sequence out of sparsify's training: its trainer's token mask is
    ``torch.isin(ids, exclude_tokens, invert=True)`` ``[batch, seq]``; that call returns the mask with those
    positions False (every other ``torch.isin`` call is unchanged)."""
    isin = torch.isin

    def masked(elements: torch.Tensor, test_elements: torch.Tensor, *rest: object, **options: object) -> torch.Tensor:
        result = isin(elements, test_elements, *rest, **options)
        if options.get("invert") and result.dim() == 2 and result.dtype == torch.bool:
            result[:, :first] = False
        return result

    torch.isin = masked  # type: ignore[assignment]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("work", type=Path)
    parser.add_argument("--batch-size", type=int, required=True, help="sequences per step")
    parser.add_argument("--lr", type=float, required=True)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--schedule", choices=["constant", "sparsify"], default="constant")
    parser.add_argument("--warmup", type=int, default=1000)
    parser.add_argument("--loss-fn", choices=["fvu", "kl"], default="fvu")
    parser.add_argument("--hookpoints", nargs="+", default=[HOOKPOINT])
    parser.add_argument("--transcode", action="store_true", help="transcoders (module input -> output)")
    parser.add_argument("--skip", action="store_true", help="a linear skip connection (skip transcoders)")
    parser.add_argument("--expansion", type=int, default=4)
    parser.add_argument("--k", type=int, default=32)
    parser.add_argument("--dead-after", type=int, default=10_000_000, help="sparsify's dead_feature_threshold")
    parser.add_argument("--exclude-first", type=int, default=0, help="positions left out of every sequence")
    parser.add_argument("--no-init", dest="init", action="store_false",
                        help="keep sparsify's own initialisation (no init_sparsify.safetensors)")
    args = parser.parse_args()
    if args.exclude_first:
        narrow_token_mask(args.exclude_first)
    train = load_file(str(args.work / "ids.safetensors"))["train"]
    dataset = [{"input_ids": row} for row in train]
    kind = AutoModel if args.loss_fn == "fvu" else AutoModelForCausalLM
    model = kind.from_pretrained(str(args.work / "model"), dtype=getattr(torch, args.dtype)).to(args.device)
    coder = SaeConfig(expansion_factor=args.expansion, k=args.k, transcode=args.transcode, skip_connection=args.skip)
    config = TrainConfig(coder, batch_size=args.batch_size, lr=args.lr,
                         lr_warmup_steps=args.warmup, optimizer="adam", auxk_alpha=1 / 32,
                         dead_feature_threshold=args.dead_after, hookpoints=args.hookpoints, log_to_wandb=False,
                         save_dir=str(args.work / "sparsify"), run_name="run", save_every=10 ** 9,
                         loss_fn=args.loss_fn)
    trainer = Trainer(config, dataset, model)  # type: ignore[arg-type]
    if args.init:
        with torch.no_grad():
            trainer.saes[HOOKPOINT].load_state_dict(load_file(str(args.work / "init_sparsify.safetensors")))
    if args.schedule == "constant":  # the scheduler set lr to 0 (warmup step 0) when it was built: back to base
        trainer.lr_schedulers = []
        for optimizer in trainer.optimizers:
            for group in optimizer.param_groups:
                group["lr"] = group["initial_lr"]
    loaded = resident_mib()
    reset_peak()
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    start, cpu = time.perf_counter(), time.process_time()
    trainer.fit()
    if args.device == "cuda":
        torch.cuda.synchronize()
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    emit({"seconds": seconds, "tokens": int(train.numel()), "tokens_per_s": train.numel() / seconds,
          "cpu_seconds": cpu, "tokens_per_cpu_s": train.numel() / cpu, "optimizer_steps": int(trainer.global_step),
          "resident_after_load_mib": loaded, "peak_during_fit_mib": peak_mib(), "maxrss_mib": max_rss_mib(),
          "cuda_peak_allocated_mib": cuda_peak_mib(args.device)}, device=args.device, indent=None)


if __name__ == "__main__":
    main()
