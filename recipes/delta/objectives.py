"""Loss terms of the delta recipes, as functions of last-position log-probabilities (their weighted sum over a batch
of rows is :meth:`recipes.delta.specs.Objective.loss_terms`).

Each term function takes ``log_probs`` ``[B, V]`` (float32 ``log_softmax`` of the logits at the last position of the
``B`` rows that belong to the term) and returns a scalar loss plus a detached scalar probability for logging.
"""

from __future__ import annotations

import torch

__all__ = ["KIND_KL", "KIND_STEER", "KIND_TARGET", "away_loss", "kl_loss", "l2_penalty", "target_nll",
           "towards_loss"]

#: Kinds of training rows (:class:`recipes.delta.rows.Row`), each scored by its own terms: a target continuation (NLL),
#: a steering prompt (towards/away), a KL prompt.
KIND_TARGET = 0
KIND_STEER = 1
KIND_KL = 2


def target_nll(log_probs: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Weighted mean negative log-likelihood of the target tokens.

    ``NLL = Σ_b w_b · (-log P(y_b)) / Σ_b w_b``; with ``w_b = 1/T`` for the ``T`` rows of a continuation, every
    continuation counts once and its tokens are averaged.

    Args:
        log_probs: ``[B, V]``.
        targets: ``[B]`` token ids.
        weights: ``[B]``.

    Returns:
        ``(nll, probability)``: scalar loss and the (detached) weighted mean ``P(y_b)``.
    """
    token_lp = log_probs.gather(-1, targets[:, None]).squeeze(-1)  # [B]
    total = weights.sum()
    nll = -(weights * token_lp).sum() / total
    probability = (weights * token_lp.detach().exp()).sum() / total
    return nll, probability


def _set_log_prob(log_probs: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """``log Σ_{t∈set} P(t)`` per row: ``[B]``."""
    return torch.logsumexp(log_probs[:, token_ids], dim=-1)


def towards_loss(log_probs: torch.Tensor, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Steer towards a token set: ``L = -mean_b log Σ_{t∈set} P(t)``.

    Args:
        log_probs: ``[B, V]``.
        token_ids: ``[K]`` token ids of the set.

    Returns:
        ``(loss, probability)``: scalar loss and the (detached) mean set probability.
    """
    set_lp = _set_log_prob(log_probs, token_ids)
    return -set_lp.mean(), set_lp.detach().exp().mean()


def away_loss(log_probs: torch.Tensor, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Steer away from a token set: ``L = -mean_b log(1 - Σ_{t∈set} P(t))``.

    Minimising it drives the set's log-probability down; unlike ``mean log P(set)`` it is bounded below (by 0) and
    its gradient vanishes once the set is improbable, so it does not push the delta without end.

    Args:
        log_probs: ``[B, V]``.
        token_ids: ``[K]`` token ids of the set.

    Returns:
        ``(loss, probability)``: scalar loss and the (detached) mean set probability.
    """
    set_lp = _set_log_prob(log_probs, token_ids)
    # log(1 - p) = log1p(-exp(log p)), clamped away from log p = 0.
    loss = -torch.log1p(-set_lp.clamp(max=-1e-6).exp()).mean()
    return loss, set_lp.detach().exp().mean()


def kl_loss(reference_log_probs: torch.Tensor, log_probs: torch.Tensor) -> torch.Tensor:
    """``KL(P_ref ‖ P) = mean_b Σ_v P_ref(v) (log P_ref(v) - log P(v))``.

    Args:
        reference_log_probs: ``[B, V]`` unpatched log-probabilities (no gradient).
        log_probs: ``[B, V]`` patched log-probabilities.

    Returns:
        Scalar loss.
    """
    return torch.nn.functional.kl_div(log_probs, reference_log_probs, log_target=True, reduction="batchmean")


def l2_penalty(deltas: list[torch.Tensor]) -> torch.Tensor:
    """``Σ_i ‖δ_i‖²`` over the deltas (scalar)."""
    return torch.stack([delta.pow(2).sum() for delta in deltas]).sum()
