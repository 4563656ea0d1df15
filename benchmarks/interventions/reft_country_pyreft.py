"""LoReFT on the held-out country task trained both ways, gradpatch's ReFTModule and pyreft 0.1.0, one run each.

The task and the gradpatch run are benchmarks/interventions/reft_country.py's (``loreft_r1_f3+l3``:
``model.layers_{L}.output``, rank 1, positions f3+l3, batch 8, AdamW without weight decay, seed 0). pyreft
(benchmarks/peers/pyreft/reft_country_side.py, its own virtualenv and process, the model rebuilt from the same float32
weights) starts from the same R (the same parametrization state), W and b and trains on the same batches in the same
order (the batches gradpatch's data module drew, left-padded the same way, the same intervened columns, the same loss:
the response tokens' mean NLL), with the same optimizer and learning rate, in a plain loop (not pyreft's HuggingFace
trainer). Then both generate greedily on the held-out prompts (5 tokens, batches of 16, the intervention on the prompt
pass only) and compute the held-out NLL per response token.

Prints JSON: per side the losses, median seconds per step (CPU and wall), the resident memory before training and its
peak during it (MiB; gradpatch's process also holds Lightning, the data module and the model's graph), the held-out
NLL and accuracy (``exact``, ``starts`` as benchmarks/interventions/reft_country.py), and the largest loss difference.

    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.interventions.reft_country_pyreft --steps 60 --lr 4e-3
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from typing import Any

import torch
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.callbacks import Callback
from safetensors.torch import load_file, save_file

from benchmarks.harness import emit, median, peak_mib, peer_python, reset_peak, resident_mib, run_module
from benchmarks.interventions.reft_country import country_data, fit_steps, score
from benchmarks.interventions.reft_pyreft import save_for_pyreft
from gradpatch.files.loaders import load_embedded_model
from gradpatch.interventions.reft import ReFTPositions
from recipes import ReFTModule
from recipes.tokens import encode, left_pad, pad_token_id


class _Batches(Callback):
    """Records each training batch (its records), loss and seconds."""

    def __init__(self) -> None:
        self.batches: list[list[Any]] = []
        self.losses: list[float] = []
        self.seconds: list[float] = []
        self.cpu_seconds: list[float] = []
        self.start = (0.0, 0.0)

    def on_train_batch_start(self, trainer: Trainer, module: ReFTModule, batch: list, batch_idx: int) -> None:
        self.batches.append(list(batch))
        self.start = (time.perf_counter(), time.process_time())

    def on_train_batch_end(self, trainer: Trainer, module: ReFTModule, outputs: dict, batch: list,
                           batch_idx: int) -> None:
        self.seconds.append(time.perf_counter() - self.start[0])
        self.cpu_seconds.append(time.process_time() - self.start[1])
        self.losses.append(float(outputs["loss"]))


def _batch(module: ReFTModule, positions: ReFTPositions, records: list, prefix: str,
           responses: bool) -> dict[str, torch.Tensor]:
    """A left-padded batch as ReFTModule builds it (prompt + response + EOS, or the prompt alone as generation
    encodes it) with the intervened columns of each row, under ``prefix``."""
    prompts = [r.prompt for r in records]
    if responses:
        tokenized = module.encode(prompts, [r.response for r in records])
        rows, prompt_lengths, response_lengths = tokenized.ids, tokenized.prompt_lengths, tokenized.response_lengths
    else:
        rows = [encode(module.tokenizer, prompt) for prompt in prompts]
        prompt_lengths, response_lengths = [len(row) for row in rows], [0] * len(rows)
    batch = left_pad(rows, module.pad_id)
    width = batch["input_ids"].shape[1]
    locations = [[width - len(row) + column for column in positions.columns(length)]
                 for row, length in zip(rows, prompt_lengths)]
    return {f"{prefix}.{name}": tensor.contiguous() for name, tensor in {
        **batch, "locations": torch.tensor(locations), "response_lengths": torch.tensor(response_lengths)}.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", help="python of pyreft's virtualenv (default: .peers/pyreft/bin/python)")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--layer", type=int, default=10)
    parser.add_argument("--lr", type=float, default=4e-3)
    args = parser.parse_args()
    model, tokenizer = load_embedded_model()
    data = country_data()
    node = f"model.layers_{args.layer}.output"
    seed_everything(0, verbose=False)
    module = ReFTModule.from_model(model, tokenizer, lr=args.lr, interventions=[
        {"node": node, "kind": "loreft", "rank": 1, "positions": "f3+l3"}])
    patch = module.intervention.patch_map()[node][0]
    state = patch.rotation.parametrizations.weight
    initial = {"original": state.original.detach().clone(), "base": state[0].base.clone(),
               "R": patch.R.detach().clone(), "W": patch.projection.weight.detach().clone(),
               "b": patch.projection.bias.detach().clone()}
    recorder = _Batches()
    before = resident_mib()
    reset_peak()
    fit_steps(module, data, args.steps, [recorder])
    peak = peak_mib()
    records = data.eval_records
    ours = {"losses": [round(x, 4) for x in recorder.losses], "cpu_seconds_per_step": median(recorder.cpu_seconds),
            "wall_seconds_per_step": median(recorder.seconds), "resident_mib_before_training": before,
            "peak_mib_during_training": peak, "heldout_nll": module.evaluate(records)["nll"],
            "heldout": score(module.generate([r.prompt for r in records], max_new_tokens=5, batch_size=16), records)}
    tensors = {name: initial[name].contiguous() for name in ("original", "base", "W", "b")}
    for i, batch in enumerate(recorder.batches):
        tensors.update(_batch(module, patch.positions, batch, f"train.{i}", responses=True))
    for j, start in enumerate(range(0, len(records), 16)):
        tensors.update(_batch(module, patch.positions, records[start:start + 16], f"nll.{j}", responses=True))
        tensors.update(_batch(module, patch.positions, records[start:start + 16], f"generate.{j}", responses=False))
    settings = {"layer": args.layer, "rank": 1, "lr": args.lr, "max_new_tokens": 5, "pad": pad_token_id(tokenizer),
                "eos": tokenizer.eos_token_id}
    tensors["settings"] = torch.tensor(list(json.dumps(settings).encode()), dtype=torch.uint8)
    with tempfile.TemporaryDirectory() as folder:
        save_for_pyreft(model, folder)
        save_file(tensors, f"{folder}/in.safetensors")
        run_module(peer_python("pyreft", args.python), "benchmarks.peers.pyreft.reft_country_side",
                   [folder, f"{folder}/in.safetensors", f"{folder}/out.safetensors"])
        theirs = load_file(f"{folder}/out.safetensors")
    generated = [theirs[f"generated.{j}"] for j in range(len(range(0, len(records), 16)))]
    texts = [tokenizer.decode(row.tolist(), skip_special_tokens=True) for block in generated for row in block]
    pyreft_losses = theirs["losses"].tolist()
    emit({
        "node": node, "rank": 1, "positions": "f3+l3", "steps": args.steps, "lr": args.lr,
        "parameters": module.parameter_count(),
        "max_abs_diff_initial_R": float((theirs["R"] - initial["R"]).abs().max()),
        "max_abs_diff_losses": max(abs(a - b) for a, b in zip(recorder.losses, pyreft_losses)),
        "nan": any(x != x for x in recorder.losses + pyreft_losses),
        "gradpatch": ours,
        "pyreft": {"losses": [round(x, 4) for x in pyreft_losses],
                   "cpu_seconds_per_step": median(theirs["cpu_seconds"].tolist()),
                   "wall_seconds_per_step": median(theirs["seconds"].tolist()),
                   "resident_mib_before_training": float(theirs["resident_mib_before_training"]),
                   "peak_mib_during_training": float(theirs["peak_mib_during_training"]),
                   "heldout_nll": float(theirs["heldout_nll_sum"] / theirs["heldout_tokens"]),
                   "heldout": score(texts, records)}})


if __name__ == "__main__":
    main()
