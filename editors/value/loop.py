"""The value search's one optimiser loop: Adam on the ``δ`` rows of ``F`` facts at once, each fact stopping on its own
(Meng et al. 2022, §3.1, eq. 4; MEMIT's batched search, Meng et al. 2023, §4.3, eq. 16).

:func:`search_values` is the loop of both searches: MEMIT's batch (:func:`editors.value.batch_search.optimize_values`
over a :class:`~editors.value.batch_objective.BatchValueObjective`) and ROME's one fact
(:func:`editors.value.search.optimize_value`: a :class:`~editors.value.search.ValueObjective` as a batch of one). The
early stop (a fact whose loss is below ``early_stop_loss`` stops before stepping and keeps its ``δ``), the norm clamp
after each step and the non-finite checks (:class:`gradpatch.finite.StepGuard`) live here only.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn

from gradpatch.finite import StepGuard
from gradpatch.model_io import wrapped_model

__all__ = ["FactsObjective", "BatchStepCallback", "ValueResult", "check_learning_rate", "frozen_parameters",
           "search_values"]

#: ``callback(step, {fact: terms})``: called once per step with the terms (floats) of every fact evaluated.
BatchStepCallback = Callable[[int, dict[int, dict[str, float]]], None]


@contextlib.contextmanager
def frozen_parameters(model: nn.Module) -> Iterator[None]:
    """Turn off ``requires_grad`` on every parameter for the block (only the delta gets gradients), then restore."""
    params = list(wrapped_model(model).parameters())
    flags = [p.requires_grad for p in params]
    try:
        for p in params:
            p.requires_grad_(False)
        yield
    finally:
        for p, flag in zip(params, flags):
            p.requires_grad_(flag)


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
    """Minimise every fact's loss with Adam from ``δ = 0``, all facts in the same forward/backward passes.

    Each step evaluates the facts still searching (in the passes of ``objective.chunks``); a fact whose loss is below
    ``early_stop_loss`` stops there, before stepping, keeps its ``δ`` and is released; the others take one Adam step
    on the summed loss (each row's gradient is its own fact's) and are clamped (``objective.project_``). The model's
    parameters are frozen meanwhile and restored after.

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
    check_learning_rate(lr)
    n = objective.v_init.shape[0]
    delta = nn.Parameter(torch.zeros_like(objective.v_init))  # [F, d_out]
    optimizer = torch.optim.Adam([delta], lr=lr)
    histories: list[list[dict[str, float]]] = [[] for _ in range(n)]
    taken = [0] * n
    active = list(range(n))
    with frozen_parameters(objective.pg), torch.enable_grad():
        for step in range(steps):
            if not active:
                break
            optimizer.zero_grad(set_to_none=True)
            stepping: list[int] = []
            evaluated: dict[int, dict[str, float]] = {}
            for chunk in objective.chunks(active):
                terms = objective.loss(delta, chunk)
                columns = {name: value.detach().tolist() for name, value in terms.items()}
                keep = []
                for j, fact in enumerate(chunk):
                    record = {name: values[j] for name, values in columns.items()}
                    guard(fact).check_terms(step, record)
                    histories[fact].append(record)
                    evaluated[fact] = record
                    if record["loss"] >= early_stop_loss:
                        keep.append(j)
                if keep:
                    terms["loss"][torch.tensor(keep, device=delta.device)].sum().backward()
                stepping += [chunk[j] for j in keep]
            if callback is not None:
                callback(step, evaluated)
            if not stepping:
                break
            for fact in stepping:
                guard(fact).check_gradient_values(step, {"delta": delta.grad[fact]}, evaluated[fact])
            kept = torch.ones(n, dtype=torch.bool, device=delta.device)  # the facts not stepping, stopped before too
            kept[torch.tensor(stepping, device=delta.device)] = False
            before = delta.detach()[kept].clone()
            with guard(stepping[0]).update(step, lr):
                optimizer.step()
            with torch.no_grad():
                delta[kept] = before  # stopped facts keep their δ (Adam's momentum would move them)
            objective.project_(delta)
            for fact in stepping:
                guard(fact).check_values(step, {"delta": delta[fact]})
                taken[fact] += 1
            objective.release(sorted(set(active) - set(stepping)))
            active = stepping
    objective.release(active)
    final = delta.detach().clone()
    return [ValueResult(delta=final[i], v_star=objective.v_init[i] + final[i], steps=taken[i], history=histories[i])
            for i in range(n)]
