"""Objectives of :class:`~recipes.interchange.InterventionModule`: pluggable loss terms of a batch's tensors.

An objective is an :class:`InterventionObjective` whose :meth:`~InterventionObjective.loss_terms` takes the
interchanged log-probabilities at each base prompt's end, the counterfactual labels, the unpatched log-probabilities
(when it reads them, :attr:`~InterventionObjective.reads_reference`) and the patches' penalty, and returns
``{"loss": scalar, ...}``; the module trains whatever it returns. :class:`IITObjective` is interchange intervention
training (Geiger et al. 2022, "Inducing Causal Structure for Interpretable Neural Networks"; the DAS objective of
Geiger et al. 2023, section 3): cross-entropy of the counterfactual label after the interchange, plus optional KL and
mask sparsity. Other objectives subclass :class:`InterventionObjective`; in YAML they are chosen with ``class_path``.
"""

from __future__ import annotations

import torch

from ..errors import RecipeConfigError

__all__ = ["IITObjective", "InterventionObjective"]


class InterventionObjective:
    """Base class: the loss an :class:`~recipes.interchange.InterventionModule` minimises."""

    @property
    def reads_reference(self) -> bool:
        """Whether :meth:`loss_terms` reads the unpatched log-probabilities (the module computes them only then)."""
        return False

    def loss_terms(self, log_probs: torch.Tensor, labels: torch.Tensor, reference: torch.Tensor | None,
                   penalty: torch.Tensor) -> dict[str, torch.Tensor]:
        """The terms on one batch of ``B`` records.

        Args:
            log_probs: ``[B, V]`` float32 next-token log-probabilities at each base prompt's end with every patch
                reading the source.
            labels: ``[B]`` the counterfactual label token ids.
            reference: ``[B, V]`` the same without patches (no gradient), or ``None`` unless :attr:`reads_reference`.
            penalty: the patches' summed :meth:`~gradpatch.interventions.subspace.TrainablePatch.penalty` (scalar).

        Returns:
            ``{"loss": scalar to minimise, ...}``: the other scalars are logged (``iia`` among them).
        """
        raise NotImplementedError(f"{type(self).__name__} must implement loss_terms(log_probs, labels, reference, "
                                  f"penalty)")


class IITObjective(InterventionObjective):
    """Interchange intervention training: L = ce_weight · CE(label | interchanged base) + kl_weight · KL +
    sparsity_weight · Σ penalty.

    - CE: ``-log P(label)`` at the base prompt's last position with every patch reading the source.
    - KL: ``KL(P_unpatched(base) ‖ P_interchanged(base))`` at that position (a weak pull towards the model's own
      distribution; 0 by default).
    - sparsity: the patches' :meth:`~gradpatch.interventions.TrainablePatch.penalty` (the L1 norm of a sigmoid mask).

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

    @property
    def reads_reference(self) -> bool:
        """The KL term reads the unpatched log-probabilities."""
        return bool(self.kl_weight)

    def loss_terms(self, log_probs: torch.Tensor, labels: torch.Tensor, reference: torch.Tensor | None,
                   penalty: torch.Tensor) -> dict[str, torch.Tensor]:
        """CE, KL (against ``reference``) and sparsity (``penalty``), weighted; ``iia`` (see the class)."""
        labels = labels.to(log_probs.device)
        terms: dict[str, torch.Tensor] = {}
        loss = log_probs.new_zeros(())
        if self.ce_weight:
            terms["ce"] = torch.nn.functional.nll_loss(log_probs, labels)
            loss = loss + self.ce_weight * terms["ce"]
        if self.kl_weight and reference is not None:
            terms["kl"] = torch.nn.functional.kl_div(log_probs, reference, log_target=True, reduction="batchmean")
            loss = loss + self.kl_weight * terms["kl"]
        if self.sparsity_weight:
            terms["sparsity"] = penalty.to(loss.device)
            loss = loss + self.sparsity_weight * terms["sparsity"]
        terms["iia"] = (log_probs.detach().argmax(-1) == labels).float().mean()
        terms["loss"] = loss
        return terms

    def describe(self) -> dict[str, float]:
        """The weights (hyperparameters for TensorBoard)."""
        return {"ce_weight": self.ce_weight, "kl_weight": self.kl_weight, "sparsity_weight": self.sparsity_weight}
