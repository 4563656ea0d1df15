"""Time of one DeltaModule training step under Lightning against the same step in a hand-written torch loop; JSON.

Both run the same frozen PatchableGraph of the same model on the same batch with the same optimizer (Adam, lr 0.05)
over one AddPatch delta (``model.layers_<mid>.output`` at the last token) and the same loss: the NLL of one-token
targets after four prompts plus ``1e-4 · ‖δ‖²``. The hand-written step has its own delta and optimizer.

Steps are timed in interleaved pairs, so that load from other processes hits both alike: ``Trainer.fit`` runs the
DeltaModule (logger, checkpointing, progress bar and model summary off) and a callback runs one hand-written step
inside every Lightning step (right after its ``on_train_batch_start`` in odd steps, in its ``on_train_batch_end``
after the optimizer step in even ones, so neither kind always runs first). With stamps ``s_i`` at each
``on_train_batch_start`` and ``h_i`` the time of the hand-written step run inside step ``i``:

    lightning_i = s_{i+1} - s_i - h_i    (everything Lightning does per step: batch fetch, hooks, forward,
                                          backward, optimizer)
    torch_i     = h_i                    (zero_grad, patched forward, loss, backward, step)

The first ``--warmup`` pairs are dropped. Reported: the median of ``lightning_i / torch_i`` (``median_ratio``, the
target is <= 1.10) and the medians of each, all from this run; the same on this process's CPU time
(``median_ratio_cpu_time``), which other processes' load disturbs less than wall time. ``--logged`` repeats the measurement with a
TensorBoardLogger and the InterventionLogger (scalars every step, histograms every 10 steps).

Run: ``.venv/bin/python -m benchmarks.engine.lightning_overhead [--tiny] [--pairs N] [--logged]``.
"""

from __future__ import annotations

import argparse
import logging
import platform
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

from lightning.pytorch import Callback, Trainer  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from benchmarks.harness import emit
from gradpatch import AddPatch, Intervention  # noqa: E402
from recipes import DeltaModule, DeltaSpec, Objective, TargetSpec  # noqa: E402
from recipes.delta.rows import PromptRows, RowCollator  # noqa: E402

TARGETS = [
    ("The Eiffel Tower is located in the city of", " Rome"),
    ("The capital of France is", " Paris"),
    ("The Colosseum is located in the city of", " Rome"),
    ("Big Ben is located in the city of", " London"),
]
L2_WEIGHT = 1e-4
LR = 0.05


def hand_written_step(module: DeltaModule) -> Callable[[], None]:
    """One step of a plain torch loop over ``module``'s graph and rows, with its own delta and Adam."""
    pg, spec = module.graph, module.delta_specs[0]
    delta = torch.nn.Parameter(torch.zeros_like(module.deltas[0]))
    intervention = Intervention({spec.node: AddPatch(value=delta, slice=(slice(None), -1))})
    optimizer = torch.optim.Adam([delta], lr=LR)
    # One pass over the rows is one batch: the rows of DeltaModule's full-batch step, collated the same way.
    loader = DataLoader(PromptRows(module.rows), batch_size=len(module.rows), collate_fn=RowCollator(module.pad_id))

    def step() -> None:
        for batch in loader:
            optimizer.zero_grad(set_to_none=True)
            with pg.patch(intervention):
                logits = pg(batch["input_ids"], attention_mask=batch["attention_mask"],
                            position_ids=batch["position_ids"], **module.call_kwargs).logits
            loss = torch.nn.functional.cross_entropy(logits[:, -1].float(), batch["target"])
            loss = loss + L2_WEIGHT * delta.pow(2).sum()
            loss.backward()
            optimizer.step()

    return step


class PairedSteps(Callback):
    """Stamps every Lightning step and runs (and times) one hand-written step inside each: at the start of odd
    steps and at the end of even ones, so neither kind of step always runs first. Wall time
    (``time.perf_counter``) and this process's CPU time (``time.process_time``) are both recorded."""

    def __init__(self, hand_step: Callable[[], None]) -> None:
        self.hand_step = hand_step
        self.starts: list[tuple[float, float]] = []
        self.hand: list[tuple[float, float]] = []

    def _timed_hand_step(self) -> None:
        wall, cpu = time.perf_counter(), time.process_time()
        self.hand_step()
        self.hand.append((time.perf_counter() - wall, time.process_time() - cpu))

    def on_train_batch_start(self, trainer: Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.starts.append((time.perf_counter(), time.process_time()))
        if len(self.starts) % 2 == 0:
            self._timed_hand_step()

    def on_train_batch_end(self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if len(self.starts) % 2 == 1:
            self._timed_hand_step()

    def pairs(self, warmup: int, clock: int) -> list[tuple[float, float]]:
        """``(lightning_i, torch_i)`` on ``clock`` (0: wall, 1: CPU) for the steps after ``warmup`` (the last
        step has no following stamp)."""
        out = []
        for i in range(len(self.starts) - 1):
            hand = self.hand[i][clock]
            out.append((self.starts[i + 1][clock] - self.starts[i][clock] - hand, hand))
        return out[warmup:]


def measure(module: DeltaModule, pairs: int, warmup: int, logged: bool, log_dir: str) -> dict[str, Any]:
    """Time ``pairs`` (Lightning, torch) step pairs after ``warmup`` ones; the summary on both clocks."""
    timer = PairedSteps(hand_written_step(module))
    callbacks: list[Callback] = [timer]
    logger: Any = False
    if logged:
        from lightning.pytorch.loggers import TensorBoardLogger

        from recipes import InterventionLogger

        logger = TensorBoardLogger(log_dir, name="bench")
        callbacks.append(InterventionLogger(max_prompts=0))
    trainer = Trainer(max_steps=pairs + warmup + 1, accelerator="cpu", logger=logger, callbacks=callbacks,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module)
    wall, cpu = timer.pairs(warmup, 0), timer.pairs(warmup, 1)
    return {
        "pairs": len(wall),
        "median_ratio": _median_ratio(wall),
        "median_lightning_step_s": round(statistics.median(light for light, _ in wall), 5),
        "median_torch_step_s": round(statistics.median(hand for _, hand in wall), 5),
        "median_ratio_cpu_time": _median_ratio(cpu),
        "median_lightning_step_cpu_s": round(statistics.median(light for light, _ in cpu), 5),
        "median_torch_step_cpu_s": round(statistics.median(hand for _, hand in cpu), 5),
    }


def _median_ratio(pairs: list[tuple[float, float]]) -> float:
    return round(statistics.median(light / hand for light, hand in pairs), 4)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="a tiny random Llama instead of SmolLM2-135M")
    parser.add_argument("--pairs", type=int, default=16, help="timed step pairs")
    parser.add_argument("--warmup", type=int, default=2, help="step pairs run before timing")
    parser.add_argument("--logged", action="store_true", help="also time Lightning with TensorBoard logging")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    for name in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)

    if args.tiny:
        from recipes.testing import tiny_backbone

        model, tokenizer = tiny_backbone()
        label = "tiny random Llama (2 layers, hidden 64)"
    else:
        from gradpatch.files.loaders import load_embedded_model

        model, tokenizer = load_embedded_model()
        label = "SmolLM2-135M-Instruct"
    layer = model.config.num_hidden_layers // 2
    objective = Objective(targets=[TargetSpec(p, t) for p, t in TARGETS], l2_weight=L2_WEIGHT)
    module = DeltaModule.from_model(model, tokenizer, deltas=[DeltaSpec(f"model.layers_{layer}.output", "last")],
                                    objective=objective, lr=LR)
    with tempfile.TemporaryDirectory() as log_dir:
        bare = measure(module, args.pairs, args.warmup, False, log_dir)
        logged = measure(module, args.pairs, args.warmup, True, log_dir) if args.logged else None
    result: dict[str, Any] = {
        "benchmark": "lightning_overhead",
        "model": label,
        "node": f"model.layers_{layer}.output@last",
        "batch_rows": len(module.rows),
        **bare,
        "target": 1.10,
    }
    result["meets_target"] = result["median_ratio"] <= result["target"]
    if logged is not None:
        result["logged"] = logged
    result.update({"threads": args.threads, "torch": torch.__version__,
                   "lightning": __import__("lightning").__version__, "python": platform.python_version()})
    emit(result)


if __name__ == "__main__":
    main()
