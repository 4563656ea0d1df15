"""gradpatch recipes: Lightning modules, TensorBoard logging, YAML configs and the ``gradpatch`` command line.

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

from editors import lazy_exports

#: Public name -> submodule that defines it.
_EXPORTS: dict[str, str] = {
    "BiPOObjective": "reft_objectives",
    "ContinuationDataModule": "continuations",
    "ContinuationNLLObjective": "reft_objectives",
    "CounterfactualDataModule": "counterfactual",
    "DeltaModule": "delta_module",
    "DeltaSpec": "specs",
    "DeviceMapStrategy": "strategies",
    "FrozenGraphModule": "frozen",
    "IITObjective": "intervention_objectives",
    "InterchangeSpec": "intervention_module",
    "InterventionLogger": "logger",
    "InterventionModule": "intervention_module",
    "InterventionObjective": "intervention_objectives",
    "Objective": "specs",
    "PartialSumsWarning": "errors",
    "SecondMomentJob": "stats_job",
    "ShardedFrozenDDPStrategy": "sharded",
    "StatisticsJobError": "errors",
    "ObjectiveModule": "objective_module",
    "PreferenceDataModule": "continuations",
    "ReFTModule": "reft_module",
    "ReFTSpec": "reft_module",
    "RecipeConfigError": "errors",
    "RecipeError": "errors",
    "Row": "data",
    "TargetSpec": "specs",
    "build_rows": "data",
    "caa_vector": "caa",
    "collate_rows": "data",
    "greedy_generate": "generation",
    "left_pad": "data",
    "run_statistics_job": "stats_job",
    "run_distributed_edit": "distributed_edit",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, install_hint="pip install 'gradpatch[recipes]'",
                                    optional=("lightning", "tensorboard", "jsonargparse"))
