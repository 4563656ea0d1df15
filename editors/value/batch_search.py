"""The batched value search: Adam on every fact's ``δ`` at once, each fact stopping on its own.

:class:`editors.value.batch_objective.BatchValueObjective` gives each fact's loss (ROME's eq. 4, Meng et al. 2022, §3.1)
for a batch in shared forward/backward passes; :func:`optimize_values` runs MEMIT's value search (Meng et al. 2023,
§4.3, eq. 16) on it with the value search's one loop (:func:`editors.value.loop.search_values`), the loop of the
one-fact search (:func:`editors.value.optimize_value`) too.
"""

from __future__ import annotations

from gradpatch.finite import StepGuard

from .batch_objective import BatchValueObjective
from .loop import BatchStepCallback, ValueResult, search_values

__all__ = ["BatchStepCallback", "optimize_values"]


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
    return search_values(objective, steps=steps, lr=lr, early_stop_loss=early_stop_loss,
                         guard=lambda fact: _fact_guard(objective, fact, lr), callback=callback)
