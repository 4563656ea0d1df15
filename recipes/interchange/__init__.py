"""Interchange intervention training: DAS, Boundless DAS and sigmoid masks at NodePaths of a frozen causal LM,
trained on counterfactual records with IIA as the validation metric.

- :class:`InterventionModule`, :class:`InterchangeSpec` (:mod:`.module`): the LightningModule (a sibling on
  :class:`~recipes.training.PatchTrainingModule`) and its specs;
- :class:`InterventionObjective`, :class:`IITObjective` (:mod:`.objectives`): loss terms of the interchanged
  log-probabilities;
- :class:`CounterfactualDataModule` (:mod:`.counterfactual`): base/source/label records from JSONL.

Names are imported on first use, so ``import recipes.interchange`` imports neither torch nor Lightning.
"""

from __future__ import annotations

from ..lazy import recipe_exports

#: Public name -> submodule that defines it.
_EXPORTS: dict[str, str] = {
    "CounterfactualDataModule": "counterfactual",
    "CounterfactualRecord": "counterfactual",
    "Encoded": "module",
    "IITObjective": "objectives",
    "InterchangeSpec": "module",
    "InterventionModule": "module",
    "InterventionObjective": "objectives",
    "PatchKind": "module",
    "build_patch": "module",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = recipe_exports(__name__, _EXPORTS)
