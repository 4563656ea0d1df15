"""Objectives of :class:`~recipes.intervention_module.InterventionModule`: pluggable loss terms on a batch.

An objective is an :class:`InterventionObjective` whose :meth:`~InterventionObjective.loss_terms` takes the module
and a batch and returns ``{"loss": scalar, ...}``; the module trains whatever it returns. :class:`IITObjective` is
interchange intervention training (Geiger et al. 2022, "Inducing Causal Structure for Interpretable Neural
Networks"; the DAS objective of Geiger et al. 2023, section 3): cross-entropy of the counterfactual label after the
interchange, plus optional KL and mask sparsity. Other objectives (continuation NLL for ReFT, preference losses)
subclass :class:`InterventionObjective`; in YAML they are chosen with ``class_path``.
"""

from __future__ import annotations

from typing import Any

import torch

from .errors import RecipeConfigError

__all__ = ["IITObjective", "InterventionObjective"]


class InterventionObjective:
    """Base class: the loss an :class:`~recipes.intervention_module.InterventionModule` minimises."""

    def loss_terms(self, module: Any, batch: Any) -> dict[str, torch.Tensor]:
        """The terms on one batch.

        Args:
            module: the :class:`~recipes.intervention_module.InterventionModule` (its ``encode``,
                ``interchange_log_probs``, ``patches``).
            batch: what its data module yields (a list of records).

        Returns:
            ``{"loss": scalar to minimise, ...}``: the other scalars are logged (``iia`` among them).
        """
        raise NotImplementedError(f"{type(self).__name__} must implement loss_terms(module, batch)")


class IITObjective(InterventionObjective):
    """Interchange intervention training: L = ce_weight · CE(label | interchanged base) + kl_weight · KL +
    sparsity_weight · Σ penalty.

    - CE: ``-log P(label)`` at the base prompt's last position with every patch reading the source.
    - KL: ``KL(P_unpatched(base) ‖ P_interchanged(base))`` at that position (a weak pull towards the model's own
      distribution; 0 by default).
    - sparsity: the patches' :meth:`~gradpatch.subspace.TrainablePatch.penalty` (the L1 norm of a sigmoid mask).

    Also returns ``iia``: the fraction of rows whose interchanged argmax is the label (detached).

    Args:
        ce_weight, kl_weight, sparsity_weight: non-negative weights.

    Raises:
        RecipeConfigError: a negative or non-finite weight, or all weights 0.
    """

    def __init__(self, ce_weight: float = 1.0, kl_weight: float = 0.0, sparsity_weight: float = 0.0) -> None:
        weights = {"ce_weight": ce_weight, "kl_weight": kl_weight, "sparsity_weight": sparsity_weight}
        for name, weight in weights.items():
            if not isinstance(weight, (int, float)) or not 0 <= weight < float("inf"):
                raise RecipeConfigError(f"IITObjective: {name} must be a finite number >= 0, got {weight!r}")
        if not any(weights.values()):
            raise RecipeConfigError("IITObjective: every weight is 0; set ce_weight (e.g. 1.0)")
        self.ce_weight, self.kl_weight, self.sparsity_weight = float(ce_weight), float(kl_weight), float(sparsity_weight)

    def loss_terms(self, module: Any, batch: Any) -> dict[str, torch.Tensor]:
        encoded = module.encode(batch)
        log_probs = module.interchange_log_probs(encoded)  # [B, V]
        labels = encoded.labels.to(log_probs.device)
        terms: dict[str, torch.Tensor] = {}
        loss = log_probs.new_zeros(())
        if self.ce_weight:
            terms["ce"] = torch.nn.functional.nll_loss(log_probs, labels)
            loss = loss + self.ce_weight * terms["ce"]
        if self.kl_weight:
            with torch.no_grad():
                reference = module.base_log_probs(encoded)
            terms["kl"] = torch.nn.functional.kl_div(log_probs, reference, log_target=True, reduction="batchmean")
            loss = loss + self.kl_weight * terms["kl"]
        if self.sparsity_weight:
            terms["sparsity"] = torch.stack([p.penalty().to(loss.device) for p in module.patches]).sum()
            loss = loss + self.sparsity_weight * terms["sparsity"]
        terms["iia"] = (log_probs.detach().argmax(-1) == labels).float().mean()
        terms["loss"] = loss
        return terms

    def describe(self) -> dict[str, float]:
        """The weights (hyperparameters for TensorBoard)."""
        return {"ce_weight": self.ce_weight, "kl_weight": self.kl_weight, "sparsity_weight": self.sparsity_weight}
