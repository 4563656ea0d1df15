"""Objectives of :class:`~recipes.reft_module.ReFTModule` (the :class:`InterventionObjective` interface).

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
from typing import Any

import torch

from .errors import RecipeConfigError
from .intervention_objectives import InterventionObjective

__all__ = ["BiPOObjective", "ContinuationNLLObjective"]


class ContinuationNLLObjective(InterventionObjective):
    """Teacher-forced NLL of the responses: ``loss = −Σ log P(response token) / number of response tokens``.

    Batches are lists of :class:`~recipes.continuations.ContinuationRecord`. Also returns ``nll`` (the same value)
    and ``tokens`` (the number of response tokens).
    """

    def loss_terms(self, module: Any, batch: Any) -> dict[str, torch.Tensor]:
        tokenized = module.encode([r.prompt for r in batch], [r.response for r in batch])
        log_probs, mask = module.token_log_probs(tokenized)
        nll = -log_probs.sum() / mask.sum()
        return {"loss": nll, "nll": nll.detach(), "tokens": mask.sum().detach()}

    def describe(self) -> dict[str, float]:
        """No hyperparameters."""
        return {}


class BiPOObjective(InterventionObjective):
    """BiPO's preference loss for ``steer`` interventions (a vector added at every token of a node).

    In training, the direction d ∈ {−1, +1} is drawn once per step (torch's generator, seeded by
    ``seed_everything``); out of training (validation) d = +1. Batches are lists of
    :class:`~recipes.continuations.PreferenceRecord`. Also returns ``margin`` (mean of d·β·[...] before the sigmoid),
    ``accuracy`` (fraction of rows with a positive margin) and ``direction`` (d).

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

    def loss_terms(self, module: Any, batch: Any) -> dict[str, torch.Tensor]:
        prompts = [r.prompt for r in batch]
        chosen = module.encode(prompts, [r.chosen for r in batch])
        rejected = module.encode(prompts, [r.rejected for r in batch])
        direction = 1.0
        if self.flip and module.training:
            direction = float(torch.randint(0, 2, ()).item() * 2 - 1)
        with torch.no_grad():
            reference = [module.token_log_probs(t, sign=None)[0].sum(-1) for t in (chosen, rejected)]
        steered = [module.token_log_probs(t, sign=direction)[0].sum(-1) for t in (chosen, rejected)]
        margin = direction * self.beta * ((steered[0] - reference[0]) - (steered[1] - reference[1]))
        loss = -torch.nn.functional.logsigmoid(margin).mean()
        return {"loss": loss, "margin": margin.detach().mean(), "accuracy": (margin.detach() > 0).float().mean(),
                "direction": torch.tensor(direction)}

    def describe(self) -> dict[str, float]:
        """β and whether d is drawn at random."""
        return {"beta": self.beta, "flip": float(self.flip)}
