"""The batched value search's optimiser loop: Adam on every fact's ``δ`` at once, each fact stopping on its own.

:class:`editors.value.batch_objective.BatchValueObjective` gives each fact's loss (ROME's eq. 4, Meng et al. 2022, §3.1) for a
batch in shared forward/backward passes; :func:`optimize_values` runs MEMIT's value search (Meng et al. 2023, §4.3,
eq. 16) on it with the stop rule and clamp of the one-fact search (:func:`editors.value.optimize_value`).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from gradpatch.finite import StepGuard

from .batch_objective import BatchValueObjective
from .search import ValueResult, frozen_parameters

__all__ = ["BatchStepCallback", "optimize_values"]

#: ``callback(step, {fact: terms})``: called once per step with the terms (floats) of every fact evaluated.
BatchStepCallback = Callable[[int, dict[int, dict[str, float]]], None]


def _fact_guard(objective: BatchValueObjective, fact: int, lr: float) -> StepGuard:
    """:func:`editors.value.value_step_guard` naming the fact."""
    return StepGuard(f"batched value step, fact {fact} (subject {objective.requests[fact].subject!r})",
                     f"lower the learning rate (lr={lr:g}) or keep the norm clamp (clamp_factor); the weights were "
                     f"not changed")


def optimize_values(
    objective: BatchValueObjective,
    *,
    steps: int = 25,
    lr: float = 0.5,
    early_stop_loss: float = 0.05,
    callback: BatchStepCallback | None = None,
) -> list[ValueResult]:
    """Minimise every fact's loss with Adam from ``δ = 0``, all facts in the same forward/backward passes.

    Each step evaluates the facts still searching (in passes of at most ``objective.max_tokens`` tokens); a fact
    whose loss is below ``early_stop_loss`` stops there, before stepping, and keeps its ``δ`` (exactly as
    :func:`editors.value.optimize_value` stops); the others take one Adam step on the summed loss (each row's
    gradient is its own fact's) and are clamped. The model's parameters are frozen meanwhile and restored after.

    Args:
        objective: the facts' losses.
        steps: maximum optimiser steps per fact (25).
        lr: Adam learning rate (0.5).
        early_stop_loss: a fact stops once its loss is below this (0.05).
        callback: called after each step's evaluations with ``(step, {fact: terms})``.

    Returns:
        One :class:`editors.value.ValueResult` per fact, in request order (``steps``: that fact's optimiser steps).

    Raises:
        ValueError: ``lr`` is not a finite positive number.
        NonFiniteError: a fact's loss term, gradient or ``δ`` became NaN or inf (the message names the fact and
            the step); nothing is returned.
    """
    if not (math.isfinite(lr) and lr > 0):
        raise ValueError(f"lr must be a finite positive number, got {lr}; ROME and MEMIT use 0.5")
    n = objective.n_facts
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
                    _fact_guard(objective, fact, lr).check_terms(step, record)
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
            rows = torch.tensor(stepping, device=delta.device)
            for fact in stepping:
                _fact_guard(objective, fact, lr).check_gradients(step, {"delta": delta.grad[fact]}, evaluated[fact])
            before = delta.detach().clone()
            with _fact_guard(objective, stepping[0], lr).update(step, lr):
                optimizer.step()
            with torch.no_grad():
                kept = torch.ones(n, dtype=torch.bool, device=delta.device)
                kept[rows] = False
                delta[kept] = before[kept]  # stopped facts keep their δ (Adam's momentum would move them)
            objective.project_(delta)
            for fact in stepping:
                _fact_guard(objective, fact, lr).check_values(step, {"delta": delta[fact]})
                taken[fact] += 1
            objective.release(sorted(set(active) - set(stepping)))
            active = stepping
    objective.release(active)
    final = delta.detach().clone()
    return [ValueResult(delta=final[i], v_star=objective.v_init[i] + final[i], steps=taken[i], history=histories[i])
            for i in range(n)]
