"""Metrics of one forward pass: a scalar from the last position's logits ``[batch, vocab]`` and the prompts.

Every metric averages over the batch, so an attribution score is the change of the mean over prompt pairs.
"""

from __future__ import annotations

from typing import Callable

import torch

from .errors import AttributionError
from .prompts import PromptBatch

__all__ = ["Metric", "answer_probability", "check_metric", "kl_to_clean", "logit_difference"]

#: ``metric(logits, batch) -> scalar``: ``logits`` is ``[batch, vocab]`` at the last position.
Metric = Callable[[torch.Tensor, PromptBatch], torch.Tensor]


def _rows(logits: torch.Tensor) -> torch.Tensor:
    return torch.arange(logits.shape[0], device=logits.device)


def logit_difference(logits: torch.Tensor, batch: PromptBatch) -> torch.Tensor:
    """Mean over prompts of ``logits[answer] - logits[foil]`` (Wang et al. 2022, the IOI logit difference).

    Args:
        logits: ``[batch, vocab]`` at the last position.
        batch: the prompts (``answer`` and ``foil`` ``[batch]``).

    Returns:
        A scalar tensor, in logits (nats of the answer/foil odds).
    """
    rows = _rows(logits)
    return (logits[rows, batch.answer.to(logits.device)] - logits[rows, batch.foil.to(logits.device)]).mean()


def answer_probability(logits: torch.Tensor, batch: PromptBatch) -> torch.Tensor:
    """Mean over prompts of the answer token's probability ``softmax(logits)[answer]``.

    Args:
        logits: ``[batch, vocab]`` at the last position.

    Returns:
        A scalar tensor in [0, 1].
    """
    return torch.softmax(logits.float(), dim=-1)[_rows(logits), batch.answer.to(logits.device)].mean()


def kl_to_clean(clean_logits: torch.Tensor) -> Metric:
    """The metric ``KL(p_clean || p)`` at the last position, mean over prompts (nats; 0 on the clean run).

    Args:
        clean_logits: ``[batch, vocab]`` last-position logits of the clean run (detached).
    """
    reference = torch.log_softmax(clean_logits.detach().float(), dim=-1)

    def kl(logits: torch.Tensor, batch: PromptBatch) -> torch.Tensor:
        log_p = torch.log_softmax(logits.float(), dim=-1)
        return (reference.exp() * (reference - log_p)).sum(-1).mean()

    return kl


def check_metric(metric: Metric, batch: PromptBatch, vocab: int | None) -> None:
    """Call ``metric`` on zero logits ``[batch, vocab]`` before any forward pass.

    Raises:
        AttributionError: ``metric`` is not callable or does not return a one-element tensor or a number.
    """
    if not callable(metric):
        raise AttributionError(f"metric must be a function metric(logits, batch) -> scalar, got "
                               f"{type(metric).__name__}")
    if vocab is None:
        return
    value = metric(torch.zeros(batch.size, vocab), batch)
    check_scalar(value)


def check_scalar(value: object) -> torch.Tensor:
    """``value`` as a 0-d tensor.

    Raises:
        AttributionError: not a one-element tensor or a number.
    """
    if isinstance(value, (int, float)):
        return torch.tensor(float(value))
    if not isinstance(value, torch.Tensor) or value.numel() != 1:
        shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise AttributionError(f"the metric returned {shape}, not a scalar: reduce it over the batch (e.g. .mean()) so "
                               f"metric(logits, batch) gives one number")
    return value.reshape(())
