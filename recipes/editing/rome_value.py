"""ROME's value step as a LightningModule, and the :class:`editors.value.ValueRunner` that runs it with ``Trainer.fit``.

The objective is the editors' own :class:`editors.value.ValueObjective` (Meng et al. 2022, eq. 4: target NLL over
the context prompts + KL on ``"{subject} is a"`` + weight decay, with ``‖δ‖ ≤ clamp · ‖v₀‖``); this module only
wraps it, and each training step is a step of the value search's one loop (:class:`editors.value.loop.ValueSearch`),
so the plain-torch runner :func:`editors.value.optimize_value` and this one run the same code::

    from editors import ROME
    from recipes.editing.rome_value import LightningValueRunner

    rome = ROME(pg, tokenizer, "model.layers_3.mlp.down_proj",
                value_runner=LightningValueRunner(logdir="runs", name="rome"))
    edit = rome.edit(request)       # the value optimisation is a Trainer.fit; scalars go to runs/rome/version_N

Each ``Trainer.fit`` logs, through :class:`~recipes.reports.logger.InterventionLogger`, ``loss/total``, ``loss/nll``,
``loss/kl``, ``loss/weight_decay``, ``prob/target`` (mean target probability over the context prompts) and
``delta_norm/<node>@subject_last`` per step, a histogram of ``δ`` and the hyperparameters.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.loggers import TensorBoardLogger
from torch import nn
from torch.utils.data import DataLoader

from editors.value import StepCallback, ValueObjective, ValueResult, frozen_parameters, one_fact_search

from ..reports.logger import InterventionLogger

__all__ = ["LightningValueRunner", "ROMEValueModule", "trainer_device_args"]

#: Lightning's notices that do not apply to an optimisation without data or validation (and its own deprecation
#: notice about torch's pytree ``LeafSpec``, raised inside Lightning on torch 2.13).
_QUIET = (r".*does not have many workers.*", r".*`training_step` returned `None`.*",
          r".*no `val_dataloader`.*", r".*`max_epochs` was not set.*", r".*LeafSpec.*")


class ROMEValueModule(LightningModule):
    """Optimise ROME's ``δ`` (added at the subject's last token of every prompt) with Lightning, on the value search's
    one loop: each training step is one :meth:`editors.value.loop.ValueSearch.step` of
    :func:`editors.value.one_fact_search` (a forward and backward pass over the context prompts and the KL prompt, the
    Adam step, the clamp :meth:`~editors.value.ValueObjective.project_`, the non-finite checks), so this runner and
    :func:`editors.value.optimize_value` take the same steps. Lightning runs the steps (manual optimisation: the
    backward pass is ``manual_backward``, the optimiser Lightning's, which counts ``global_step``); training stops
    before the update once the loss is below ``early_stop_loss``, as in the reference code.

    Args:
        objective: the value objective of one fact.
        lr: Adam learning rate (0.5 in the reference code).
        early_stop_loss: stop threshold (0.05).
        callback: called with ``(step, terms as floats)`` after each loss evaluation.

    Attributes:
        search: the :class:`~editors.value.loop.ValueSearch` (``δ`` is its ``delta``, ``[1, d_out]``).

    Raises:
        ValueError: ``lr`` is not a finite positive number.
    """

    def __init__(self, objective: ValueObjective, lr: float = 0.5, early_stop_loss: float = 0.05,
                 callback: StepCallback | None = None) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.value_objective = objective
        self.lr, self.early_stop_loss = lr, early_stop_loss
        self.search = one_fact_search(objective, lr=lr, early_stop_loss=early_stop_loss, callback=callback,
                                      backward=self.manual_backward, optimizer_step=self._optimizer_step)
        self.delta = self.search.delta  # registered, so Lightning places it and the logger sees it

    @property
    def history(self) -> list[dict[str, float]]:
        """The terms of every loss evaluation, as floats (``loss``, ``nll``, ``kl``, ``weight_decay``,
        ``target_prob``)."""
        return self.search.histories[0]

    @property
    def deltas(self) -> list[nn.Parameter]:
        """``[δ]`` (for :class:`~recipes.reports.logger.InterventionLogger`)."""
        return [self.delta]

    def delta_names(self) -> list[str]:
        """``["<layer output node>@subject_last"]``."""
        return [f"{self.value_objective.layer.output_node}@subject_last"]

    def configure_optimizers(self) -> torch.optim.Optimizer:
        """The search's Adam over ``δ``."""
        return self.search.optimizer

    def _optimizer_step(self) -> None:
        self.optimizers().step()  # type: ignore[union-attr]

    def train_dataloader(self) -> DataLoader:
        """Empty batches, one per step (the trainer's ``max_steps`` decides how many run)."""
        return DataLoader(range(_STEPS_PER_EPOCH), batch_size=1, collate_fn=_no_batch)

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any] | None:
        """One step of the search; stops training (no update) once the loss is below ``early_stop_loss``.

        Returns:
            ``{"terms": ...}`` for the logger (the step's terms, ``p_target`` and ``norm/0`` = ``‖δ‖`` when evaluated),
            or ``None`` when the search stopped.

        Raises:
            NonFiniteError: a loss term, the gradient or ``δ`` became NaN or inf (:func:`editors.value.value_step_guard`).
        """
        norm = float(self.delta.detach().norm())
        if not self.search.step():
            self.trainer.should_stop = True
            return None
        terms = dict(self.history[-1])
        terms["p_target"] = terms.pop("target_prob")  # logged as prob/target
        return {"terms": terms | {"norm/0": norm}}

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
            "optimizer": "adam",
            "early_stop_loss": self.early_stop_loss,
        }


#: Empty batches per epoch (the trainer's ``max_steps`` stops the fit).
_STEPS_PER_EPOCH = 1000


def _no_batch(items: list[int]) -> dict[str, Any]:
    return {}


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
            :class:`~recipes.reports.logger.InterventionLogger`. ``None``: no logging.
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
            with torch.enable_grad():  # the graph is no submodule of the module: Lightning never moves the model
                Trainer(**kwargs).fit(module)
        (result,) = module.search.results()
        result.log_dir = None if logger is None else logger.log_dir
        return result
