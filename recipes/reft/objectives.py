"""Objectives of :class:`~recipes.reft.ReFTModule` (the :class:`ReFTObjective` interface): loss terms of the
response tokens' log-probabilities the module computes.

- :class:`ContinuationNLLObjective`: ReFT's training loss (Wu et al. 2024, arXiv 2404.03592, section 4): the model
  frozen, the prompt's positions intervened, the negative log-likelihood of the response tokens under teacher
  forcing, averaged over the batch's response tokens.
- :class:`BiPOObjective`: bi-directional preference optimisation of a steering vector v (Cao et al. 2024,
  "Personalized Steering of Large Language Models: Versatile Steering Vectors Through Bi-directional Preference
  Optimization", arXiv 2406.00045, eq. 4): with d drawn from {−1, +1} each step,
  L = −log σ(d·β·[log π(r_T | q, A + d·v)/π(r_T | q, A) − log π(r_O | q, A + d·v)/π(r_O | q, A)]), r_T the chosen
  and r_O the rejected continuation, π(·|q, A) the unsteered model.
"""

from __future__ import annotations

import math

import torch

from ..errors import RecipeConfigError

__all__ = ["BiPOObjective", "ContinuationNLLObjective", "ReFTObjective"]


class ReFTObjective:
    """Base class: the loss a :class:`~recipes.reft.ReFTModule` minimises, on continuation records
    (:meth:`continuation_terms`) or on preference records (:meth:`preference_terms`); each objective scores one of
    the two."""

    def direction(self, training: bool) -> float:
        """The sign the steering vectors are added with in this step's preference passes (``+1`` here)."""
        return 1.0

    def continuation_terms(self, log_probs: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
        """The terms of a batch of continuation records.

        Args:
            log_probs: ``[B, T]`` teacher-forced log-probabilities of the response tokens, the intervention applied
                (0 where ``mask`` is 0).
            mask: ``[B, T]`` 1 at response tokens, 0 at padding.

        Returns:
            ``{"loss": scalar to minimise, ...}``: the other scalars are logged.

        Raises:
            RecipeConfigError: this objective scores preference records.
        """
        raise RecipeConfigError(f"{type(self).__name__} scores preference records ({{prompt, chosen, rejected}}); "
                                f"use ContinuationNLLObjective for {{prompt, response}} records")

    def preference_terms(self, steered: tuple[torch.Tensor, torch.Tensor], reference: tuple[torch.Tensor, torch.Tensor],
                         direction: float) -> dict[str, torch.Tensor]:
        """The terms of a batch of preference records.

        Args:
            steered: ``([B], [B])`` log-probabilities of the chosen and of the rejected responses (summed over their
                tokens) with the intervention applied, steering vectors times ``direction``.
            reference: the same without the intervention (no gradient).
            direction: :meth:`direction` of this step.

        Returns:
            ``{"loss": scalar to minimise, ...}``: the other scalars are logged.

        Raises:
            RecipeConfigError: this objective scores continuation records.
        """
        raise RecipeConfigError(f"{type(self).__name__} scores continuation records ({{prompt, response}}); use "
                                f"BiPOObjective for {{prompt, chosen, rejected}} records")


class ContinuationNLLObjective(ReFTObjective):
    """Teacher-forced NLL of the responses: ``loss = −Σ log P(response token) / number of response tokens``.

    Batches are lists of :class:`~recipes.reft.continuations.ContinuationRecord`. Also returns ``nll`` (the same
    value) and ``tokens`` (the number of response tokens).
    """

    def continuation_terms(self, log_probs: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
        """NLL per response token (see the class)."""
        nll = -log_probs.sum() / mask.sum()
        return {"loss": nll, "nll": nll.detach(), "tokens": mask.sum().detach()}

    def describe(self) -> dict[str, float]:
        """No hyperparameters."""
        return {}


class BiPOObjective(ReFTObjective):
    """BiPO's preference loss for ``steer`` interventions (a vector added at every token of a node).

    In training, the direction d ∈ {−1, +1} is drawn once per step (torch's generator, seeded by
    ``seed_everything``); out of training (validation) d = +1. Batches are lists of
    :class:`~recipes.reft.continuations.PreferenceRecord`. Also returns ``margin`` (mean of d·β·[...] before the
    sigmoid), ``accuracy`` (fraction of rows with a positive margin) and ``direction`` (d).

    Args:
        beta: β > 0 (0.1 in the paper).
        flip: draw d at random (the paper); ``False`` keeps d = +1 (one-directional DPO on the vector).

    Raises:
        RecipeConfigError: β not a finite positive number.
    """

    def __init__(self, beta: float = 0.1, flip: bool = True) -> None:
        if not isinstance(beta, (int, float)) or not (math.isfinite(beta) and beta > 0):
            raise RecipeConfigError(f"BiPOObjective: beta must be a finite number > 0, got {beta!r}; e.g. 0.1")
        self.beta, self.flip = float(beta), bool(flip)

    def direction(self, training: bool) -> float:
        """d drawn from {−1, +1} in training when :attr:`flip`, else ``+1``."""
        if self.flip and training:
            return float(torch.randint(0, 2, ()).item() * 2 - 1)
        return 1.0

    def preference_terms(self, steered: tuple[torch.Tensor, torch.Tensor], reference: tuple[torch.Tensor, torch.Tensor],
                         direction: float) -> dict[str, torch.Tensor]:
        """BiPO's loss (see the class)."""
        margin = direction * self.beta * ((steered[0] - reference[0]) - (steered[1] - reference[1]))
        loss = -torch.nn.functional.logsigmoid(margin).mean()
        return {"loss": loss, "margin": margin.detach().mean(), "accuracy": (margin.detach() > 0).float().mean(),
                "direction": torch.tensor(direction)}

    def describe(self) -> dict[str, float]:
        """β and whether d is drawn at random."""
        return {"beta": self.beta, "flip": float(self.flip)}
