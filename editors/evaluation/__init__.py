"""CounterFact evaluation (Meng et al. 2022, section 4.2): cases, their scores (efficacy, paraphrase,
neighbourhood, and per prompt form of the prompt-form suite) and the loop that edits, scores and restores, one fact
or a batch at a time.

Names are imported on first use (:func:`editors.lazy.lazy_exports`).
"""

from __future__ import annotations

from ..lazy import lazy_exports

#: Public name -> submodule that defines it.
_EXPORTS: dict[str, str] = {
    "CounterFactCase": "counterfact",
    "load_cases": "counterfact",
    "save_cases": "counterfact",
    "FORMS": "forms",
    "candidate_forms": "forms",
    "known_forms": "forms",
    "EDIT_INFO_KEYS": "scores",
    "form_summary": "scores",
    "case_row": "scores",
    "evaluate_cases": "sequential",
    "mentions_subject": "scores",
    "neighborhood_fraction": "scores",
    "score_case": "scores",
    "score_cases": "scores",
    "score_summary": "scores",
    "AppliedBatch": "sequential",
    "BatchApplier": "sequential",
    "batch_applier": "sequential",
    "evaluate_sequential": "sequential",
    "rome_applier": "sequential",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
