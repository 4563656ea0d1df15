"""Delta recipes: AddPatch deltas at NodePaths of a frozen causal LM, trained on target continuations and steering
prompts with KL and L2 regularisers.

- :class:`DeltaModule` (:mod:`.module`): the LightningModule (a sibling on
  :class:`~recipes.training.PatchTrainingModule`);
- :class:`DeltaSpec`, :class:`TargetSpec`, :class:`Objective` (:mod:`.specs`): what ``recipes/configs/steer_*.yaml``
  spell out;
- the loss terms (:mod:`.objectives`) and the training rows (:mod:`.rows`).

Names are imported on first use, so ``import recipes.delta`` imports neither torch nor Lightning.
"""

from __future__ import annotations

from ..lazy import recipe_exports

#: Public name -> submodule that defines it.
_EXPORTS: dict[str, str] = {
    "DeltaModule": "module",
    "DeltaSpec": "specs",
    "Objective": "specs",
    "PromptRows": "rows",
    "Row": "rows",
    "RowCollator": "rows",
    "TargetSpec": "specs",
    "build_rows": "rows",
    "collate_rows": "rows",
    "position_slice": "specs",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = recipe_exports(__name__, _EXPORTS)
