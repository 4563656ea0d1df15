"""Finiteness checks for optimisations of patch values: stop at the first NaN or ±inf, saying where and why.

An optimisation whose loss or gradient turns non-finite never comes back (Adam's moments hold the NaN), and what it
leaves behind must not be applied or exported. :class:`StepGuard` is used by every optimisation loop in the
project (the recipes' Lightning modules and ROME's value runners)::

    guard = StepGuard("ROME value step", fix="lower lr (0.5 now) or keep the norm clamp")
    terms = objective(delta)                      # {"loss": ..., "nll": ..., ...}
    guard.check_terms(step, terms)
    terms["loss"].backward()
    guard.check_gradients(step, {"delta": delta}, terms)
    with guard.update(step, lr):
        optimizer.step()
    guard.check_values(step, {"delta": delta})
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch

from .errors import NonFiniteError

__all__ = ["StepGuard", "check_finite", "non_finite_names"]


def non_finite_names(named: Mapping[str, torch.Tensor | float]) -> list[str]:
    """Names whose tensor (any element) or float is NaN or ±inf, in mapping order.

    Tensors are screened by their sums, one reduction each and one host synchronisation per device (a NaN or ±inf
    element makes the sum NaN or ±inf); only a tensor whose sum is not finite is checked element by element, so a
    sum that overflows from finite elements is not reported."""
    bad: set[str] = set()
    tensors = {name: value.detach() for name, value in named.items()
               if isinstance(value, torch.Tensor) and value.numel()}
    for name, value in named.items():
        if not isinstance(value, torch.Tensor) and not math.isfinite(float(value)):
            bad.add(name)
    by_device: dict[torch.device, list[str]] = {}
    for name, value in tensors.items():
        by_device.setdefault(value.device, []).append(name)
    for names in by_device.values():
        screened = torch.isfinite(torch.stack([tensors[name].sum().float() for name in names])).tolist()
        bad.update(name for name, finite in zip(names, screened)
                   if not finite and not bool(torch.isfinite(tensors[name]).all()))
    return [name for name in named if name in bad]


def check_finite(named: Mapping[str, torch.Tensor], what: str, fix: str) -> None:
    """Raise unless every tensor is finite.

    Args:
        named: name -> tensor (any shape).
        what: what the tensors are, for the message (``"intervention values"``).
        fix: what to do about it.

    Raises:
        NonFiniteError: naming the first non-finite entries.
    """
    bad = non_finite_names(named)
    if bad:
        raise NonFiniteError(f"{what} {', '.join(repr(name) for name in bad)} hold NaN or inf; {fix}")


def _scalars(terms: Mapping[str, torch.Tensor | float]) -> str:
    shown = []
    for name, value in terms.items():
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                continue
            value = float(value.detach())
        shown.append(f"{name}={value:.4g}")
    return ", ".join(shown)


@dataclass(frozen=True)
class StepGuard:
    """Stops an optimisation at the first non-finite loss term, gradient or updated value.

    Steps are counted from 0, as the optimisation's history and callbacks count them.

    Attributes:
        where: the optimisation, for messages (``"DeltaModule"``, ``"ROME value step"``).
        fix: the remedy appended to every message (``"lower lr (1e3 now) or set max_norm"``).
    """

    where: str
    fix: str

    def check_terms(self, step: int, terms: Mapping[str, torch.Tensor | float]) -> None:
        """Raise if a loss term (scalar tensors or floats: ``loss``, ``nll``, ...) is NaN or ±inf.

        Raises:
            NonFiniteError: naming the step and every non-finite term.
        """
        bad = non_finite_names(terms)
        if bad:
            raise NonFiniteError(f"{self.where}: term {', '.join(repr(n) for n in bad)} is non-finite at step "
                                 f"{step} ({_scalars(terms)}); {self.fix}")

    def check_gradients(self, step: int, parameters: Mapping[str, torch.Tensor],
                        terms: Mapping[str, torch.Tensor | float]) -> None:
        """Raise if a parameter's ``.grad`` is NaN or ±inf after the backward pass of step ``step``.

        Args:
            parameters: name -> optimised tensor (those without a gradient are skipped).
            terms: the loss terms of the step, shown in the message.

        Raises:
            NonFiniteError: naming the step, the parameters and the loss terms' values.
        """
        self.check_gradient_values(step, {name: p.grad for name, p in parameters.items() if p.grad is not None}, terms)

    def check_gradient_values(self, step: int, gradients: Mapping[str, torch.Tensor],
                              terms: Mapping[str, torch.Tensor | float]) -> None:
        """:meth:`check_gradients` on gradient tensors themselves (a row of a batched parameter's ``.grad``, say).

        Raises:
            NonFiniteError: naming the step, the gradients' names and the loss terms' values.
        """
        bad = non_finite_names(gradients)
        if bad:
            raise NonFiniteError(f"{self.where}: the gradient of {', '.join(repr(n) for n in bad)} is non-finite at "
                                 f"step {step} although the loss terms are finite ({_scalars(terms)}); {self.fix}")

    def check_values(self, step: int, parameters: Mapping[str, torch.Tensor]) -> None:
        """Raise if the optimizer update of step ``step`` left a parameter NaN or ±inf.

        Raises:
            NonFiniteError: naming the step and the parameters.
        """
        bad = non_finite_names(parameters)
        if bad:
            raise NonFiniteError(f"{self.where}: the optimizer update at step {step} made "
                                 f"{', '.join(repr(n) for n in bad)} non-finite; {self.fix}")

    @contextlib.contextmanager
    def update(self, step: int, lr: float) -> Iterator[None]:
        """Around ``optimizer.step()``: torch's ``value cannot be converted to type float without overflow`` (an
        update scale such as ``lr / (1 - beta1)`` beyond the parameter dtype's range) becomes a NonFiniteError.

        Raises:
            NonFiniteError: naming the step and the learning rate.
        """
        try:
            yield
        except RuntimeError as error:
            if "overflow" not in str(error):
                raise
            raise NonFiniteError(f"{self.where}: the optimizer update at step {step} overflowed ({error}): "
                                 f"lr={lr:g} is far too large; {self.fix}") from error
