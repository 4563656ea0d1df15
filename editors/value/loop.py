"""The value search's one optimiser loop: Adam on the ``δ`` rows of ``F`` facts at once, each fact stopping on its own
(Meng et al. 2022, §3.1, eq. 4; MEMIT's batched search, Meng et al. 2023, §4.3, eq. 16).

:class:`ValueSearch` (one step at a time; :func:`search_values` runs it to the end) is the loop of every value search:
MEMIT's batch (:func:`editors.value.batch_search.optimize_values` over a
:class:`~editors.value.batch_objective.BatchValueObjective`) and ROME's one fact as a batch of one
(:func:`editors.value.search.one_fact_search`), run by :func:`editors.value.search.optimize_value` or, one training step
per step, by ``recipes.rome_value.LightningValueRunner``. The early stop (a fact whose loss is below
``early_stop_loss`` stops before stepping and keeps its ``δ``), the norm clamp after each step and the non-finite checks
(:class:`gradpatch.finite.StepGuard`) live here only.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn

from gradpatch.finite import StepGuard
from gradpatch.model_io import frozen_parameters

__all__ = ["BatchStepCallback", "FactsObjective", "ValueResult", "ValueSearch", "check_learning_rate",
           "frozen_parameters", "run_search", "search_values"]

#: ``callback(step, {fact: terms})``: called once per step with the terms (floats) of every fact evaluated.
BatchStepCallback = Callable[[int, dict[int, dict[str, float]]], None]


@dataclass
class ValueResult:
    """Outcome of the value optimisation of one fact.

    Attributes:
        delta: optimised ``δ`` ``[d_out]`` (detached).
        v_star: ``v₀ + δ`` ``[d_out]``.
        steps: optimiser steps taken.
        history: per-step loss terms (floats).
        log_dir: the folder the runner logged the search to (a TensorBoard run of
            ``recipes.rome_value.LightningValueRunner``), so a caller can add its own records there; ``None``: not
            logged.
    """

    delta: torch.Tensor
    v_star: torch.Tensor
    steps: int
    history: list[dict[str, float]] = field(default_factory=list)
    log_dir: str | None = None

    def converged(self, early_stop_loss: float) -> bool:
        """Whether the search converged: its last evaluated loss is finite and below ``early_stop_loss`` or below
        its first loss (an edit from a search that did not converge is not applied unless asked for)."""
        if not self.history:
            return False
        first, last = self.history[0]["loss"], self.history[-1]["loss"]
        return math.isfinite(last) and (last < early_stop_loss or last < first)


class FactsObjective(Protocol):
    """What :func:`search_values` minimises: the loss of each of ``F`` facts, each fact's from its own ``δ`` row.

    Attributes:
        pg: the model (its parameters are frozen during the search).
        v_init: ``[F, d_out]`` (``v₀`` per fact; the search starts at ``δ = 0`` of this shape).
    """

    pg: nn.Module
    v_init: torch.Tensor

    def chunks(self, facts: Sequence[int]) -> list[list[int]]:
        """``facts`` cut into the groups of one forward pass each."""
        ...

    def loss(self, delta: torch.Tensor, facts: Sequence[int]) -> dict[str, torch.Tensor]:
        """``{"loss", ...}``, each ``[len(facts)]``, differentiable with respect to ``delta`` ``[F, d_out]``."""
        ...

    def project_(self, delta: torch.Tensor) -> None:
        """Clamp every row of ``delta`` ``[F, d_out]`` in place."""
        ...

    def release(self, facts: Sequence[int]) -> None:
        """Free what is kept for ``facts`` while they are searched (they stopped)."""
        ...


def check_learning_rate(lr: float) -> None:
    """Raise ``ValueError`` unless ``lr`` is a finite positive number (ROME and MEMIT use 0.5)."""
    if not (math.isfinite(lr) and lr > 0):
        raise ValueError(f"lr must be a finite positive number, got {lr}; ROME and MEMIT use 0.5")


def search_values(objective: FactsObjective, *, steps: int, lr: float, early_stop_loss: float,
                  guard: Callable[[int], StepGuard], callback: BatchStepCallback | None = None) -> list[ValueResult]:
    """Minimise every fact's loss with Adam from ``δ = 0``, all facts in the same forward/backward passes: at most
    ``steps`` :meth:`ValueSearch.step` calls, the model's parameters frozen meanwhile and restored after.

    Args:
        objective: the facts' losses (:class:`FactsObjective`).
        steps: maximum optimiser steps per fact.
        lr: Adam learning rate.
        early_stop_loss: a fact stops once its loss is below this.
        guard: fact -> the :class:`~gradpatch.finite.StepGuard` that reports its non-finite terms, gradient or ``δ``.
        callback: called after each step's evaluations with ``(step, {fact: terms})``.

    Returns:
        One :class:`ValueResult` per fact, in order (``steps``: that fact's optimiser steps).

    Raises:
        ValueError: ``lr`` is not a finite positive number.
        NonFiniteError: a fact's loss term, gradient or ``δ`` became NaN or inf (the fact's guard names the step);
            nothing is returned.
    """
    return run_search(ValueSearch(objective, lr=lr, early_stop_loss=early_stop_loss, guard=guard, callback=callback),
                      steps)


def run_search(search: "ValueSearch", steps: int) -> list[ValueResult]:
    """At most ``steps`` :meth:`ValueSearch.step` calls (fewer once every fact stopped), the model's parameters frozen
    meanwhile and restored after; the :meth:`ValueSearch.results`."""
    with frozen_parameters(search.objective.pg), torch.enable_grad():
        for _ in range(steps):
            if not search.step():
                break
    return search.results()


class ValueSearch:
    """The value search one step at a time (:func:`search_values` runs it; ``recipes.rome_value`` runs it under
    ``Trainer.fit``, one step per training step).

    Each :meth:`step` evaluates the facts still searching (in the passes of ``objective.chunks``); a fact whose loss
    is below ``early_stop_loss`` stops there, before stepping, keeps its ``δ`` and is released; the others take one
    Adam step on the summed loss (each row's gradient is its own fact's) and are clamped (``objective.project_``).

    Args:
        objective: the facts' losses (:class:`FactsObjective`).
        lr: Adam learning rate.
        early_stop_loss: a fact stops once its loss is below this.
        guard: fact -> the :class:`~gradpatch.finite.StepGuard` that reports its non-finite terms, gradient or ``δ``.
        callback: called after each step's evaluations with ``(step, {fact: terms})``.
        backward: runs the backward pass of a loss (default ``loss.backward()``; Lightning's ``manual_backward``).
        optimizer_step: steps the optimiser (default :attr:`optimizer`'s ``step``; Lightning's optimiser wrapper,
            which counts the trainer's steps).

    Attributes:
        delta: ``[F, d_out]`` ``nn.Parameter``, from ``δ = 0``.
        optimizer: Adam over :attr:`delta`.
        histories: per fact, the terms (floats) of each evaluation.

    Raises:
        ValueError: ``lr`` is not a finite positive number.
    """

    def __init__(self, objective: FactsObjective, *, lr: float, early_stop_loss: float,
                 guard: Callable[[int], StepGuard], callback: BatchStepCallback | None = None,
                 backward: Callable[[torch.Tensor], None] | None = None,
                 optimizer_step: Callable[[], object] | None = None) -> None:
        check_learning_rate(lr)
        self.objective, self.lr, self.early_stop_loss = objective, lr, early_stop_loss
        self.guard, self.callback = guard, callback
        self.backward = backward if backward is not None else torch.Tensor.backward
        n = objective.v_init.shape[0]
        self.delta = nn.Parameter(torch.zeros_like(objective.v_init))  # [F, d_out]
        self.optimizer = torch.optim.Adam([self.delta], lr=lr)
        self.optimizer_step = optimizer_step if optimizer_step is not None else self.optimizer.step
        self.histories: list[list[dict[str, float]]] = [[] for _ in range(n)]
        self.taken = [0] * n
        self.active = list(range(n))
        self.n_steps = 0  # step() calls so far (the step number the guards and callbacks see)

    def step(self) -> bool:
        """Evaluate the facts still searching and step those whose loss is not below ``early_stop_loss`` (gradients
        on; the caller freezes the model's parameters).

        Returns:
            Whether a fact took an optimiser step (``False``: every fact has stopped; nothing was updated).

        Raises:
            NonFiniteError: a fact's loss term, gradient or ``δ`` became NaN or inf.
        """
        if not self.active:
            return False
        step, delta, n = self.n_steps, self.delta, len(self.taken)
        self.n_steps += 1
        self.optimizer.zero_grad(set_to_none=True)
        stepping: list[int] = []
        evaluated: dict[int, dict[str, float]] = {}
        for chunk in self.objective.chunks(self.active):
            terms = self.objective.loss(delta, chunk)
            columns = {name: value.detach().tolist() for name, value in terms.items()}
            keep = []
            for j, fact in enumerate(chunk):
                record = {name: values[j] for name, values in columns.items()}
                self.guard(fact).check_terms(step, record)
                self.histories[fact].append(record)
                evaluated[fact] = record
                if record["loss"] >= self.early_stop_loss:
                    keep.append(j)
            if keep:
                self.backward(terms["loss"][torch.tensor(keep, device=delta.device)].sum())
            stepping += [chunk[j] for j in keep]
        if self.callback is not None:
            self.callback(step, evaluated)
        if not stepping:
            self.objective.release(self.active)
            self.active = []
            return False
        for fact in stepping:
            self.guard(fact).check_gradient_values(step, {"delta": delta.grad[fact]}, evaluated[fact])
        kept = torch.ones(n, dtype=torch.bool, device=delta.device)  # the facts not stepping, stopped before too
        kept[torch.tensor(stepping, device=delta.device)] = False
        before = delta.detach()[kept].clone()
        with self.guard(stepping[0]).update(step, self.lr):
            self.optimizer_step()
        with torch.no_grad():
            delta[kept] = before  # stopped facts keep their δ (Adam's momentum would move them)
        self.objective.project_(delta)
        for fact in stepping:
            self.guard(fact).check_values(step, {"delta": delta[fact]})
            self.taken[fact] += 1
        self.objective.release(sorted(set(self.active) - set(stepping)))
        self.active = stepping
        return True

    def results(self) -> list[ValueResult]:
        """One :class:`ValueResult` per fact, in order (``δ`` on ``v_init``'s device); releases the facts still
        searching."""
        self.objective.release(self.active)
        self.active = []
        v_init = self.objective.v_init
        final = self.delta.detach().to(v_init.device, v_init.dtype).clone()
        return [ValueResult(delta=final[i], v_star=v_init[i] + final[i], steps=self.taken[i],
                            history=self.histories[i]) for i in range(len(self.taken))]
