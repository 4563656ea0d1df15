"""The editors' jobs under Lightning: ROME's value step and recipe, the second-moment statistics job, and a
MEMIT/AlphaEdit batch edit with its facts split over processes.

- :class:`LightningValueRunner`, :class:`ROMEValueModule` (:mod:`.rome_value`): the value search under
  ``Trainer.fit``;
- :func:`run_rome`, :class:`ROMERun` (:mod:`.rome_recipe`): key → statistics → value → update → evaluation;
- :class:`SecondMomentJob`, :func:`run_statistics_job` (:mod:`.stats_job`, partial sums in :mod:`.stats_partial`):
  statistics split over the ranks of a Lightning strategy, resumable;
- :func:`run_distributed_edit` (:mod:`.distributed_edit`, process groups in :mod:`.process_group`).

Names are imported on first use, so ``import recipes.editing`` imports neither torch nor Lightning.
"""

from __future__ import annotations

from ..lazy import recipe_exports

#: Public name -> submodule that defines it.
_EXPORTS: dict[str, str] = {
    "LightningValueRunner": "rome_value",
    "ROMERun": "rome_recipe",
    "ROMEValueModule": "rome_value",
    "SecondMomentJob": "stats_job",
    "edit_node": "rome_recipe",
    "evaluate_rome": "rome_recipe",
    "rewrite_probabilities": "rome_recipe",
    "run_distributed_edit": "distributed_edit",
    "run_rome": "rome_recipe",
    "run_statistics_job": "stats_job",
    "shard_indices": "stats_job",
    "trainer_device_args": "rome_value",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = recipe_exports(__name__, _EXPORTS)
