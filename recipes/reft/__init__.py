"""Representation fine-tuning and trained steering: LoReFT/DiReFT patches at a prompt's first/last tokens trained on
continuations, steering vectors trained with BiPO's preference loss or computed as CAA's mean difference.

- :class:`ReFTModule`, :class:`ReFTSpec` (:mod:`.module`): the LightningModule (a sibling on
  :class:`~recipes.training.PatchTrainingModule`) and its specs;
- :class:`ReFTObjective`, :class:`ContinuationNLLObjective`, :class:`BiPOObjective` (:mod:`.objectives`): loss terms
  of the response tokens' log-probabilities;
- :class:`ContinuationDataModule`, :class:`PreferenceDataModule` (:mod:`.continuations`): JSONL records;
- :func:`caa_vector` (:mod:`.caa`).

Names are imported on first use, so ``import recipes.reft`` imports neither torch nor Lightning.
"""

from __future__ import annotations

from ..lazy import recipe_exports

#: Public name -> submodule that defines it.
_EXPORTS: dict[str, str] = {
    "BiPOObjective": "objectives",
    "ContinuationDataModule": "continuations",
    "ContinuationNLLObjective": "objectives",
    "ContinuationRecord": "continuations",
    "PreferenceDataModule": "continuations",
    "PreferenceRecord": "continuations",
    "ReFTKind": "module",
    "ReFTModule": "module",
    "ReFTObjective": "objectives",
    "ReFTSpec": "module",
    "Tokenized": "module",
    "build_reft_patches": "module",
    "caa_vector": "caa",
    "continuation_mean_activations": "caa",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = recipe_exports(__name__, _EXPORTS)
