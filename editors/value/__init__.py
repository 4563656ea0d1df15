"""The value search: the layer output ``v*`` that makes the model predict the new target (Meng et al. 2022, eq. 4), for
one fact (ROME's :func:`optimize_value`, any :class:`ValueRunner`) or for a batch of facts at once (MEMIT's
:func:`optimize_values` over a :class:`BatchValueObjective`), optionally on a lower-precision copy of the model.

Names are imported on first use (:func:`editors.lazy.lazy_exports`).
"""

from __future__ import annotations

from ..lazy import lazy_exports

#: Public name -> submodule that defines it.
_EXPORTS: dict[str, str] = {
    "BatchValueObjective": "batch_objective",
    "math_attention": "batch_objective",
    "search_attention": "batch_objective",
    "BatchStepCallback": "loop",
    "optimize_values": "batch_search",
    "StepCallback": "search",
    "ValueObjective": "search",
    "ValuePrompts": "search",
    "ValueRunner": "search",
    "encode_value_prompts": "search",
    "one_fact_search": "search",
    "optimize_value": "search",
    "value_step_guard": "search",
    "value_terms": "search",
    "FactsObjective": "loop",
    "ValueResult": "loop",
    "ValueSearch": "loop",
    "check_learning_rate": "loop",
    "frozen_parameters": "loop",
    "run_search": "loop",
    "search_values": "loop",
    "SEARCH_DTYPES": "search_copy",
    "SearchCopy": "search_copy",
    "search_dtype": "search_copy",
    "TrueAnswerTerm": "true_answer",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
