"""ROME's value step as a LightningModule, and the :class:`editors.value.ValueRunner` that runs it with ``Trainer.fit``.

The objective is the editors' own :class:`editors.value.ValueObjective` (Meng et al. 2022, eq. 4: target NLL over
the context prompts + KL on ``"{subject} is a"`` + weight decay, with ``‖δ‖ ≤ clamp · ‖v₀‖``); this module only
wraps it, so the plain-torch runner :func:`editors.value.optimize_value` and this one minimise the same code::

    from editors import ROME
    from recipes.rome_value import LightningValueRunner

    rome = ROME(pg, tokenizer, "model.layers_3.mlp.down_proj",
                value_runner=LightningValueRunner(logdir="runs", name="rome"))
    edit = rome.edit(request)       # the value optimisation is a Trainer.fit; scalars go to runs/rome/version_N

Each ``Trainer.fit`` logs, through :class:`~recipes.logger.InterventionLogger`, ``loss/total``, ``loss/nll``,
``loss/kl``, ``loss/weight_decay``, ``prob/target`` (mean target probability over the context prompts) and
``delta_norm/<node>@subject_last`` per step, a histogram of ``δ`` and the hyperparameters.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.loggers import TensorBoardLogger
from torch import nn

from editors.value import StepCallback, ValueObjective, ValueResult, frozen_parameters, value_step_guard
from gradpatch.finite import StepGuard
from gradpatch.model_io import model_device

from .frozen import GRAPH_ATTRIBUTE
from .logger import InterventionLogger
from .objective_module import ObjectiveModule

__all__ = ["LightningValueRunner", "ROMEValueModule", "trainer_device_args"]

#: Lightning's notices that do not apply to an optimisation without data or validation (and its own deprecation
#: notice about torch's pytree ``LeafSpec``, raised inside Lightning on torch 2.13).
_QUIET = (r".*does not have many workers.*", r".*`training_step` returned `None`.*",
          r".*no `val_dataloader`.*", r".*`max_epochs` was not set.*", r".*LeafSpec.*")


class ROMEValueModule(ObjectiveModule):
    """Optimise ROME's ``δ`` ``[d_out]`` (added at the subject's last token of every prompt) with Lightning.

    One training step is one evaluation of :meth:`editors.value.ValueObjective.loss` (a forward and backward pass
    over the context prompts and the KL prompt); after each optimizer step ``δ`` is clamped with
    :meth:`~editors.value.ValueObjective.project_`; training stops before the update once the loss is below
    ``early_stop_loss``, as in the reference code.

    Args:
        objective: the value objective of one fact.
        lr: Adam learning rate (0.5 in the reference code).
        early_stop_loss: stop threshold (0.05).
        callback: called with ``(step, terms as floats)`` after each loss evaluation.

    Attributes:
        history: the terms of every loss evaluation, as floats (``loss``, ``nll``, ``kl``, ``weight_decay``,
            ``target_prob``).
    """

    def __init__(self, objective: ValueObjective, lr: float = 0.5, early_stop_loss: float = 0.05,
                 callback: StepCallback | None = None) -> None:
        super().__init__(objective.pg, {"delta": torch.zeros_like(objective.v_init)}, objective=self._objective,
                         project=self._project, lr=lr, optimizer="adam", early_stop_loss=early_stop_loss)
        self.value_objective = objective
        self.callback = callback
        self.history: list[dict[str, float]] = []

    def _objective(self, values: Mapping[str, nn.Parameter]) -> dict[str, torch.Tensor]:
        terms = self.value_objective.loss(values["delta"])
        record = {name: float(value.detach()) for name, value in terms.items()}
        if self.callback is not None:
            self.callback(len(self.history), record)
        self.history.append(record)
        terms["p_target"] = terms.pop("target_prob")  # logged as prob/target
        return terms

    def _project(self, values: Mapping[str, nn.Parameter]) -> None:
        self.value_objective.project_(values["delta"])

    def step_guard(self) -> StepGuard:
        """The plain runner's reports (:func:`editors.value.value_step_guard`): both runners fail alike."""
        return value_step_guard(self.lr)

    def on_train_end(self) -> None:
        """Let go of the graph before Lightning's teardown, which moves the whole module to the CPU: the edited
        model stays on its device (and keeps its extracted graphs)."""
        self._modules.pop(GRAPH_ATTRIBUTE, None)

    def delta_names(self) -> list[str]:
        """``["<layer output node>@subject_last"]``."""
        return [f"{self.value_objective.layer.output_node}@subject_last"]

    def describe(self) -> dict[str, Any]:
        """Hyperparameters for TensorBoard: the fact, the node, the loss weights, the optimiser."""
        objective = self.value_objective
        request = objective.request
        return {
            "recipe": "rome-value",
            "node": objective.layer.output_node,
            "prompt": request.prompt,
            "subject": request.subject,
            "target_new": request.target_new,
            "n_rewrite_prompts": len(objective.rewrite),
            "kl_factor": objective.kl_factor,
            "weight_decay": objective.weight_decay,
            "clamp_factor": objective.clamp_factor,
            "lr": self.lr,
            "optimizer": self.optimizer_name,
            "early_stop_loss": self.early_stop_loss,
        }


@contextlib.contextmanager
def _quiet_lightning_info(quiet: bool) -> Iterator[None]:
    """Hide Lightning's per-fit INFO lines ("GPU available: ...") while ``quiet``; warnings still show."""
    log = logging.getLogger("lightning.pytorch")
    level = log.level
    if quiet:
        log.setLevel(logging.WARNING)
    try:
        yield
    finally:
        log.setLevel(level)


def _return_to(pg: nn.Module, device: torch.device) -> None:
    """Move ``pg`` back to ``device`` if Lightning moved it away."""
    if model_device(pg) != device:
        pg.to(device)


def trainer_device_args(device: torch.device) -> dict[str, Any]:
    """``Trainer`` arguments that keep training on ``device`` (the one the model already lives on).

    Args:
        device: e.g. ``torch.device("cuda", 1)`` or ``torch.device("cpu")``.

    Returns:
        ``{"accelerator": ..., "devices": ...}``.
    """
    if device.type == "cuda":
        return {"accelerator": "gpu", "devices": [device.index or 0]}
    if device.type == "mps":
        return {"accelerator": "mps", "devices": 1}
    return {"accelerator": "cpu", "devices": 1}


@dataclass
class LightningValueRunner:
    """A :class:`editors.value.ValueRunner` that minimises the value objective with ``Trainer.fit``.

    Args:
        logdir: TensorBoard folder; each call writes a new run ``<logdir>/<name>/version_<n>`` through
            :class:`~recipes.logger.InterventionLogger`. ``None``: no logging.
        name: run name under ``logdir``.
        progress: show Lightning's progress bar.
        trainer_kwargs: more ``Trainer`` arguments (they override the runner's).
    """

    logdir: str | Path | None = None
    name: str = "rome"
    progress: bool = False
    trainer_kwargs: dict[str, Any] = field(default_factory=dict)

    def __call__(self, objective: ValueObjective, *, steps: int, lr: float, early_stop_loss: float,
                 callback: StepCallback | None = None) -> ValueResult:
        """Run the optimisation (at most ``steps`` Adam steps) and return ``δ``.

        Returns:
            :class:`editors.value.ValueResult` with ``steps`` = optimizer steps taken, the per-evaluation history and
            ``log_dir``, the TensorBoard run (``None`` without ``logdir``), so a recipe can add its own records
            (generations before and after the edit) to the same run.
        """
        logger = None if self.logdir is None else TensorBoardLogger(str(self.logdir), name=self.name,
                                                                    default_hp_metric=False)
        kwargs: dict[str, Any] = {
            "max_steps": steps,
            "logger": logger if logger is not None else False,
            "callbacks": [InterventionLogger(histogram_every_n_steps=0)] if logger is not None else [],
            "enable_checkpointing": False,
            "enable_model_summary": False,
            "enable_progress_bar": self.progress,
            "log_every_n_steps": 1,
            **trainer_device_args(objective.device),
            **self.trainer_kwargs,
        }
        with warnings.catch_warnings(), _quiet_lightning_info(not self.progress), frozen_parameters(objective.pg):
            for pattern in _QUIET:
                warnings.filterwarnings("ignore", message=pattern)
            module = ROMEValueModule(objective, lr=lr, early_stop_loss=early_stop_loss, callback=callback)
            trainer = Trainer(**kwargs)
            try:
                with torch.enable_grad():
                    trainer.fit(module)
            finally:
                _return_to(objective.pg, objective.device)  # a failed fit's teardown moved the model to the CPU
        delta = module.values["delta"].detach().to(objective.v_init.device, objective.v_init.dtype).clone()
        # Every loss evaluation but an early-stopping one was followed by an optimizer step (Lightning's global_step
        # also counts the skipped one).
        steps = len(module.history) - int(module.stopped_early)
        return ValueResult(delta=delta, v_star=objective.v_init + delta, steps=steps, history=module.history,
                           log_dir=None if logger is None else logger.log_dir)
