"""Training on a frozen graph: what every recipe's LightningModule shares.

- :class:`FrozenGraphModule` (:mod:`.frozen`): the graph's weights frozen and in ``eval()``, only the trainable
  tensors in the optimizer and in checkpoints, non-finite steps stopped and named;
- :class:`PatchTrainingModule` (:mod:`.patches`): specs → patches → an :class:`gradpatch.Intervention`, export and
  load, :meth:`~PatchTrainingModule.from_model`; the base of :class:`recipes.delta.DeltaModule`,
  :class:`recipes.interchange.InterventionModule` and :class:`recipes.reft.ReFTModule`;
- :class:`ObjectiveModule` (:mod:`.objective_module`): a few tensors against any objective callable (ROME's value
  step);
- :func:`as_spec` / :func:`spec_dict` (:mod:`.specs`): spec dataclasses from YAML mappings and back.

Names are imported on first use, so ``import recipes.training`` imports neither torch nor Lightning.
"""

from __future__ import annotations

from ..lazy import recipe_exports

#: Public name -> submodule that defines it.
_EXPORTS: dict[str, str] = {
    "DtypeName": "frozen",
    "EMBEDDED_MODEL_LABEL": "frozen",
    "FrozenGraphModule": "frozen",
    "ObjectiveModule": "objective_module",
    "OptimizerName": "frozen",
    "PatchTrainingModule": "patches",
    "as_spec": "specs",
    "call_constants": "frozen",
    "spec_dict": "specs",
    "term_scalars": "frozen",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = recipe_exports(__name__, _EXPORTS)
