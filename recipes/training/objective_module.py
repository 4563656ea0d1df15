"""ObjectiveModule: optimise a few tensors against any objective callable, with Lightning.

This is the extension point for objectives that build their own patches, such as ROME's value step
(``editors.value.ValueObjective``, whose ``loss(delta)`` adds the delta at each prompt's subject token with an
index slice and returns ``{"loss", "nll", "kl", "weight_decay", "target_prob"}``)::

    from lightning.pytorch import Trainer
    from recipes import ObjectiveModule

    objective = ValueObjective(pg, tokenizer, layer, request, templates, v_init)
    module = ObjectiveModule(pg, {"delta": torch.zeros_like(v_init)},
                             objective=lambda values: objective.loss(values["delta"]),
                             project=lambda values: objective.project_(values["delta"]),
                             lr=0.5, early_stop_loss=0.05)
    Trainer(max_steps=25, logger=False, enable_checkpointing=False).fit(module)
    delta = module.values["delta"].detach()

It inherits the frozen-graph behaviour of :class:`~recipes.training.frozen.FrozenGraphModule` (weights frozen and in
``eval()``, only the tensors in optimizer and checkpoints). Each step is one call of the objective; there is no data
(the dataloader yields an empty batch per step).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from gradpatch.finite import StepGuard

from ..errors import RecipeConfigError
from .frozen import FrozenGraphModule, OptimizerName

__all__ = ["ObjectiveFn", "ObjectiveModule", "ProjectFn"]

#: ``objective(values) -> {"loss": scalar, other scalars...}``: differentiable with respect to the values.
ObjectiveFn = Callable[[Mapping[str, nn.Parameter]], Mapping[str, torch.Tensor]]
#: ``project(values) -> None``: changes the values in place after each optimizer step (norm clamps, say).
ProjectFn = Callable[[Mapping[str, nn.Parameter]], None]


class _Steps(Dataset):
    """``length`` empty batches."""

    def __init__(self, length: int) -> None:
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {}


def _collate_empty(items: list[dict[str, Any]]) -> dict[str, Any]:
    return {}


class ObjectiveModule(FrozenGraphModule):
    """Optimise named tensors against ``objective``; the graph ``pg`` is held frozen.

    Args:
        pg: the :class:`gradpatch.PatchableGraph` the objective runs (registered and frozen here).
        values: name -> initial tensor; each becomes an ``nn.Parameter`` in ``self.values`` (a ParameterDict).
        objective: ``objective(self.values) -> {"loss": scalar, ...}``; other scalars are logged as terms.
        lr: learning rate.
        optimizer: ``"adam"``, ``"adamw"`` or ``"sgd"``.
        project: called with ``self.values`` after each optimizer step (in place, no gradient).
        early_stop_loss: when the loss falls below it, training stops before that step's update (as ROME's
            reference runner does).
        steps_per_epoch: empty batches per epoch (the trainer's ``max_steps`` decides the total).

    Raises:
        RecipeConfigError: no values, or ``objective`` returns no ``"loss"``.
    """

    def __init__(self, pg: nn.Module, values: Mapping[str, torch.Tensor], objective: ObjectiveFn,
                 lr: float = 0.05, optimizer: OptimizerName = "adam", project: ProjectFn | None = None,
                 early_stop_loss: float | None = None, steps_per_epoch: int = 1000) -> None:
        super().__init__(lr=lr, optimizer=optimizer)
        if not values:
            raise RecipeConfigError("ObjectiveModule needs at least one tensor to optimise in values")
        self.attach_graph(pg)
        self.values = nn.ParameterDict({name: nn.Parameter(value.detach().clone().float())
                                        for name, value in values.items()})
        self.objective = objective
        self.project = project
        self.early_stop_loss = early_stop_loss
        self.steps_per_epoch = steps_per_epoch
        self.stopped_early = False

    @property
    def deltas(self) -> list[nn.Parameter]:
        """The optimised tensors (for :class:`~recipes.reports.InterventionLogger`)."""
        return list(self.values.values())

    def delta_names(self) -> list[str]:
        """Names of the optimised tensors."""
        return list(self.values.keys())

    def step_guard(self) -> StepGuard:
        """Non-finite steps are reported as ``ObjectiveModule`` errors whose fix names ``lr`` and ``project``."""
        return StepGuard(type(self).__name__, f"lower the learning rate (lr={self.lr:g}) or bound the values with "
                                              f"project")

    def train_dataloader(self) -> DataLoader:
        """``steps_per_epoch`` empty batches."""
        return DataLoader(_Steps(self.steps_per_epoch), batch_size=1, collate_fn=_collate_empty)

    def loss_terms(self, batch: Any) -> dict[str, torch.Tensor]:
        """``objective(self.values)`` plus ``norm/<i>`` per tensor.

        Raises:
            RecipeConfigError: the objective's result has no ``"loss"``.
        """
        terms = dict(self.objective(self.values))
        if "loss" not in terms:
            raise RecipeConfigError(f"the objective returned {sorted(terms)}; it must return a 'loss' entry")
        for i, value in enumerate(self.values.values()):
            terms[f"norm/{i}"] = value.detach().norm()
        return terms

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any] | None:
        """One objective call; stops training (skipping the update) once the loss is below ``early_stop_loss``."""
        result = super().training_step(batch, batch_idx)
        if self.early_stop_loss is not None and float(result["loss"].detach()) < self.early_stop_loss:
            self.stopped_early = True
            self.trainer.should_stop = True
            return None
        return result

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        """Apply ``project`` after the optimizer step."""
        if self.project is not None and outputs is not None:
            with torch.no_grad():
                self.project(self.values)
