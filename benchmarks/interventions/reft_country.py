"""LoReFT and DiReFT against the full-vector additive baseline at the same positions, on a held-out answer-format task.

Task (benchmarks/interventions/build_reft_data.py): "Which country is the city of X in? Answer in one word.\\n" ->
"<country>" on the embedded SmolLM2-135M-Instruct; 96 training cities, 64 held-out cities (their countries occur in
training). Each intervention is trained with :class:`recipes.ReFTModule` (continuation NLL, same data order, seed,
steps, learning rate) at ``model.layers_{L}.output``, positions f3+l3; then greedy KV-cache generation on the held-out
prompts. ``exact``: the continuation is the country and nothing else; ``starts``: it begins with the country. The
frozen model without any intervention is the baseline row. Prints JSON (one object per run, losses every step).

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python -m benchmarks.interventions.reft_country --steps 60
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.callbacks import Callback

from benchmarks.harness import emit, median
from gradpatch.files.loaders import load_embedded_model
from recipes import ContinuationDataModule, ReFTModule

DATA = Path(__file__).resolve().parents[1] / "data"


class _Losses(Callback):
    """Records each step's loss and seconds."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.seconds: list[float] = []
        self.start = 0.0

    def on_train_batch_start(self, trainer: Trainer, module: ReFTModule, batch: list, batch_idx: int) -> None:
        self.start = time.process_time()

    def on_train_batch_end(self, trainer: Trainer, module: ReFTModule, outputs: dict, batch: list,
                           batch_idx: int) -> None:
        self.seconds.append(time.process_time() - self.start)
        self.losses.append(round(float(outputs["loss"]), 4))


def _accuracy(module: ReFTModule, records: list, generate: bool) -> dict[str, float]:
    prompts = [r.prompt for r in records]
    texts = module.generate(prompts, max_new_tokens=5, batch_size=16) if generate else None
    if texts is None:
        from recipes.generation import generate_with_patches

        texts = generate_with_patches(module.graph, module.tokenizer, {}, prompts, 5, 16)
    return score(texts, records)


def score(texts: list[str], records: list) -> dict[str, float | list[str]]:
    """Held-out accuracy of continuations ``texts`` of ``records``' prompts: ``exact`` (the country alone, a final
    period allowed), ``starts`` (begins with the country), and the first three continuations."""
    exact = sum(t.strip().rstrip(".") == r.response for t, r in zip(texts, records))
    starts = sum(t.strip().startswith(r.response) for t, r in zip(texts, records))
    return {"exact": exact / len(records), "starts": starts / len(records), "examples": texts[:3]}


def country_data() -> ContinuationDataModule:
    """The held-out country task (``loreft_country_{train,eval}.jsonl``), set up, batches of 8."""
    data = ContinuationDataModule(str(DATA / "loreft_country_train.jsonl"), str(DATA / "loreft_country_eval.jsonl"),
                                  batch_size=8)
    data.setup()
    return data


def fit_steps(module: ReFTModule, data: ContinuationDataModule, steps: int, callbacks: list[Callback]) -> None:
    """``steps`` training steps under Lightning's Trainer, without logger, checkpoints, progress bar or validation."""
    Trainer(max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
            callbacks=callbacks).fit(module, datamodule=data)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--layer", type=int, default=10)
    parser.add_argument("--lr", type=float, default=4e-3)
    parser.add_argument("--runs", nargs="*", default=None, help="run names to do (default: all)")
    args = parser.parse_args()
    model, tokenizer = load_embedded_model()
    data = country_data()
    node = f"model.layers_{args.layer}.output"
    runs = {"none": None,
            "add_f3+l3": {"node": node, "kind": "add", "positions": "f3+l3"},
            "loreft_r1_f3+l3": {"node": node, "kind": "loreft", "rank": 1, "positions": "f3+l3"},
            "direft_r1_f3+l3": {"node": node, "kind": "direft", "rank": 1, "positions": "f3+l3"},
            "loreft_r4_f3+l3_untied": {"node": node, "kind": "loreft", "rank": 4, "positions": "f3+l3",
                                       "tied": False}}
    for name, spec in runs.items():
        if args.runs and name not in args.runs:
            continue
        seed_everything(0, verbose=False)
        module = ReFTModule.from_model(model, tokenizer, lr=args.lr, interventions=[
            spec or {"node": node, "kind": "add", "positions": "f3+l3"}])
        result: dict = {"run": name, "node": node, "steps": 0, "lr": args.lr}
        if spec is not None:
            losses = _Losses()
            fit_steps(module, data, args.steps, [losses])
            result.update(steps=args.steps, parameters=module.parameter_count(), losses=losses.losses,
                          cpu_seconds_per_step=median(losses.seconds),
                          nan=any(l != l for l in losses.losses))
        result.update(module.evaluate(data.eval_records))
        result["heldout"] = _accuracy(module, data.eval_records, generate=spec is not None)
        emit(result, indent=None)


if __name__ == "__main__":
    main()
