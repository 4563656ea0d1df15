"""gradpatch recipes: Lightning modules, TensorBoard logging, YAML configs and the ``gradpatch`` command line.

A house with rooms by concern, each a sub-package whose ``__init__`` (with ``__all__``) is its front door:
:mod:`recipes.training` (the frozen graph and :class:`PatchTrainingModule`, the base of the three intervention
modules; :class:`ObjectiveModule`), :mod:`recipes.delta`, :mod:`recipes.interchange`, :mod:`recipes.reft` (the three
siblings, each with its specs, objectives and data), :mod:`recipes.editing` (ROME's value runner and recipe, the
statistics job, the distributed edit), :mod:`recipes.reports` (TensorBoard logger, attribution reports, trace images)
and :mod:`recipes.cli`; at the door, what the rooms share: :mod:`.errors`, :mod:`.tokens`, :mod:`.generation`,
:mod:`.jsonl`, the strategies (:mod:`.strategies`, :mod:`.sharded`) and :mod:`.testing`. The names below are
re-exported here.

- :class:`DeltaModule`: learn AddPatch deltas (an :class:`gradpatch.Intervention`) at NodePaths of a frozen model,
  for target continuations, steering towards/away from tokens, with KL and L2 regularisers.
- :class:`InterventionModule`: train trainable interchange patches (DAS, Boundless DAS, sigmoid masks) on
  counterfactual JSONL records (:class:`CounterfactualDataModule`) with a pluggable objective (:class:`IITObjective`).
- :class:`ReFTModule`: train LoReFT/DiReFT patches at a prompt's first/last tokens on continuations
  (:class:`ContinuationDataModule`, :class:`ContinuationNLLObjective`), or steering vectors with BiPO's preference
  loss (:class:`PreferenceDataModule`, :class:`BiPOObjective`); :func:`caa_vector` is CAA's mean difference.
- :class:`ObjectiveModule`: optimise tensors against any objective callable (the extension point for ROME's value
  step).
- :class:`InterventionLogger`: TensorBoard scalars, histograms, generations and hyperparameters.
- :class:`DeviceMapStrategy`: train on a model spread over devices by accelerate (``device_map="auto"``).
- :class:`ShardedFrozenDDPStrategy`: DDP for the trainable patches with the frozen model sharded by FSDP2.
- :func:`run_distributed_edit`: a MEMIT/AlphaEdit batch edit with its facts split over Lightning-launched processes.
- :class:`SecondMomentJob` / :func:`run_statistics_job`: second-moment statistics split over the ranks of a Lightning
  strategy (DDP, several nodes), resumable from per-rank checkpoints, written as the editors' cache files.
- the ``gradpatch`` command (:mod:`recipes.cli`, one module per command): ``gradpatch fit --config
  recipes/configs/steer_eiffel.yaml``, ``graph``, ``rome``, ``eval-rome``, ``eval-edit``, ``trace``, ``stats``.

The names are imported on first use (:func:`editors.lazy.lazy_exports`), so ``recipes.cli`` (the ``gradpatch``
command) works without Lightning and without importing torch for ``--help``; the Lightning parts need ``pip install 'gradpatch[recipes]'`` (Lightning, TensorBoard, jsonargparse[signatures]).
"""

from __future__ import annotations

from .lazy import recipe_exports

#: Public name -> submodule that defines it.
_EXPORTS: dict[str, str] = {
    "BiPOObjective": "reft",
    "ContinuationDataModule": "reft",
    "ContinuationNLLObjective": "reft",
    "CounterfactualDataModule": "interchange",
    "DeltaModule": "delta",
    "DeltaSpec": "delta",
    "DeviceMapStrategy": "strategies",
    "FrozenGraphModule": "training",
    "IITObjective": "interchange",
    "InterchangeSpec": "interchange",
    "InterventionLogger": "reports",
    "InterventionModule": "interchange",
    "InterventionObjective": "interchange",
    "Objective": "delta",
    "ObjectiveModule": "training",
    "PartialSumsWarning": "errors",
    "PatchTrainingModule": "training",
    "PreferenceDataModule": "reft",
    "ReFTModule": "reft",
    "ReFTObjective": "reft",
    "ReFTSpec": "reft",
    "RecipeConfigError": "errors",
    "RecipeError": "errors",
    "Row": "delta",
    "SecondMomentJob": "editing",
    "ShardedFrozenDDPStrategy": "sharded",
    "StatisticsJobError": "errors",
    "TargetSpec": "delta",
    "build_rows": "delta",
    "caa_vector": "reft",
    "collate_rows": "delta",
    "greedy_generate": "generation",
    "left_pad": "tokens",
    "run_distributed_edit": "editing",
    "run_statistics_job": "editing",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = recipe_exports(__name__, _EXPORTS)
