"""What the recipes write for people to read: TensorBoard logs of interventions, attribution reports and causal-trace
images.

- :class:`InterventionLogger`, :func:`generations_table` (:mod:`.logger`): TensorBoard scalars, histograms,
  generations and hyperparameters of a training run;
- :func:`save_attribution` (:mod:`.attribution_report`): an attribution result's JSON, heatmaps, faithfulness curve
  and TensorBoard run;
- :func:`save_circuit` (:mod:`.circuit_report`): an attribution graph's files, HTML page, interventions and
  TensorBoard run;
- :func:`log_trace_to_tensorboard` (:mod:`.trace_tensorboard`): a causal trace's heatmaps as TensorBoard images.

Names are imported on first use, so ``import recipes.reports`` imports neither torch nor Lightning.
"""

from __future__ import annotations

from ..lazy import recipe_exports

#: Public name -> submodule that defines it.
_EXPORTS: dict[str, str] = {
    "InterventionLogger": "logger",
    "generations_table": "logger",
    "intervention_record": "circuit_report",
    "log_trace_to_tensorboard": "trace_tensorboard",
    "save_circuit": "circuit_report",
    "save_attribution": "attribution_report",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = recipe_exports(__name__, _EXPORTS)
