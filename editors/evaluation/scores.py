"""CounterFact scores of edits (Meng et al. 2022, section 4.2); the loop that edits, scores and restores is
:mod:`editors.evaluation.sequential`. Probabilities are mean token log-probabilities of ``prompt + " " + target``:

- efficacy: ``P(new) > P(true)`` on the rewrite prompt;
- paraphrase: the fraction of paraphrase prompts with ``P(new) > P(true)``;
- neighbourhood: the fraction of neighbourhood prompts with ``P(true) > P(new)``;
- forms: per prompt form of the case (``form_prompts``, :mod:`editors.evaluation.forms`), ``P(new) > P(true)``.

The scores are means over cases.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from torch import nn

from gradpatch import PatchableGraph
from gradpatch.model_io import model_device

from ..passes.scoring import mean_target_logprobs
from ..passes.selected_logits import target_logprobs_at
from .counterfact import CounterFactCase

__all__ = ["EDIT_INFO_KEYS", "case_row", "form_summary", "mentions_subject", "neighborhood_fraction", "score_case",
           "score_cases", "score_summary"]

#: The fields of an edit's ``info`` (its value search) that a case row keeps under ``"edit"``.
EDIT_INFO_KEYS = ("steps", "converged", "loss", "nll", "kl", "target_prob", "delta_norm", "v_init_norm", "timings_s",
                  "rewrite")


def score_cases(pg: nn.Module, tokenizer: Any, cases: Sequence[CounterFactCase], batch_size: int = 64
                ) -> list[dict[str, Any]]:
    """Score cases on the model as it is now, the prompts of many cases in each forward pass.

    Args:
        pg: the model's PatchableGraph (or model).
        tokenizer: its tokenizer.
        cases: the cases.
        batch_size: prompt/target pairs per forward pass.

    Returns:
        One row per case: ``efficacy`` (0/1), ``paraphrase`` and ``neighborhood`` (fractions, ``None`` without such
        prompts), ``forms`` (form name -> 0/1, ``P(new) > P(true)`` on the case's prompt in that form), and the mean
        log-probabilities ``logp_new`` / ``logp_true`` per prompt group (``rewrite``, ``paraphrase``,
        ``neighborhood``, ``forms``).
    """
    groups_of = [{"rewrite": [c.request.text], "paraphrase": list(c.paraphrase_prompts),
                  "neighborhood": list(c.neighborhood_prompts), "forms": list(c.form_prompts.values())}
                 for c in cases]
    prompts, targets = [], []
    for case, groups in zip(cases, groups_of):
        for target in (case.request.target_new, case.request.target_true):
            for group in groups.values():
                prompts += group
                targets += [target] * len(group)
    if isinstance(pg, PatchableGraph):  # the output embedding runs at the target tokens only
        scores = target_logprobs_at(pg, tokenizer, prompts, targets, batch_size=batch_size).tolist()
    else:
        device = model_device(pg)
        scores = mean_target_logprobs(lambda ids: pg(ids.to(device), use_cache=False), tokenizer, prompts, targets,
                                      batch_size=batch_size).tolist()
    rows, i = [], 0
    for case, groups in zip(cases, groups_of):
        row: dict[str, Any] = {"logp_new": {}, "logp_true": {}}
        for which in ("logp_new", "logp_true"):
            for name, group in groups.items():
                row[which][name] = scores[i : i + len(group)]
                i += len(group)
        row["efficacy"] = _fraction(row, "rewrite", True)
        row["paraphrase"] = _fraction(row, "paraphrase", True)
        row["neighborhood"] = _fraction(row, "neighborhood", False)
        row["forms"] = {name: float(new > true) for name, new, true in
                        zip(case.form_prompts, row["logp_new"]["forms"], row["logp_true"]["forms"])}
        rows.append(row)
    return rows


def _fraction(row: Mapping[str, Any], name: str, want_new: bool, keep: Sequence[bool] | None = None) -> float | None:
    """The fraction of a group's prompts (those where ``keep`` is true, if given) preferring ``target_new``
    (``want_new``) or ``target_true``; ``None`` without such prompts."""
    pairs = list(zip(row["logp_new"][name], row["logp_true"][name]))
    if keep is not None:
        pairs = [pair for pair, kept in zip(pairs, keep) if kept]
    if not pairs:
        return None
    return sum((n > t) if want_new else (t > n) for n, t in pairs) / len(pairs)


def mentions_subject(subjects: Iterable[str]) -> Callable[[str], bool]:
    """``prompt -> bool``: whether the prompt names one of ``subjects`` as a whole word (case-sensitive).

    Used to leave out of the neighbourhood score the prompts about a subject that is itself edited in the same
    batch or group: such a prompt measures that subject's own edit, not whether unrelated facts were kept.
    """
    names = sorted({s for s in subjects if s}, key=len, reverse=True)
    if not names:
        return lambda prompt: False
    pattern = re.compile(r"(?<!\w)(?:" + "|".join(map(re.escape, names)) + r")(?!\w)")
    return lambda prompt: pattern.search(prompt) is not None


def neighborhood_fraction(row: Mapping[str, Any], keep: Sequence[bool] | None = None) -> float | None:
    """The neighbourhood score of a :func:`score_cases` row over the prompts where ``keep`` is true (one flag per
    neighbourhood prompt; all of them without ``keep``): the fraction with ``P(true) > P(new)``; ``None`` if none is
    kept."""
    return _fraction(row, "neighborhood", False, keep)


def case_row(case: CounterFactCase, pre: Mapping[str, Any], post: Mapping[str, Any],
             keep: Sequence[bool] | None = None) -> dict[str, Any]:
    """One case's row of an evaluation: its request, its scores after the edit (``post``, a :func:`score_cases`
    row) and before (``pre``), and both rows' log-probabilities. ``keep`` flags the neighbourhood prompts that count
    (:func:`neighborhood_fraction`), before and after alike."""
    request = case.request
    return {"case_id": case.case_id, "subject": request.subject, "prompt": request.text,
            "target_true": request.target_true, "target_new": request.target_new,
            "efficacy": post["efficacy"], "paraphrase": post["paraphrase"],
            "neighborhood": neighborhood_fraction(post, keep), "forms": post["forms"],
            "pre": {"efficacy": pre["efficacy"], "paraphrase": pre["paraphrase"],
                    "neighborhood": neighborhood_fraction(pre, keep), "forms": pre["forms"]},
            "logp": {"pre": {"new": pre["logp_new"], "true": pre["logp_true"]},
                     "post": {"new": post["logp_new"], "true": post["logp_true"]}}}


def score_case(pg: nn.Module, tokenizer: Any, case: CounterFactCase) -> dict[str, Any]:
    """Score one case on the model as it is now (one batched forward pass): :func:`score_cases` of one case.

    Returns:
        ``efficacy`` (0/1), ``paraphrase`` and ``neighborhood`` (fractions), and the mean log-probabilities
        ``logp_new`` / ``logp_true`` per prompt group (``rewrite``, ``paraphrase``, ``neighborhood``).
    """
    return score_cases(pg, tokenizer, [case])[0]


def _mean(values: Sequence[float | None]) -> float | None:
    kept = [v for v in values if v is not None]
    return sum(kept) / len(kept) if kept else None


def score_summary(rows: Sequence[Mapping[str, Any]]) -> dict[str, float | None]:
    """``{"efficacy_score", "paraphrase_score", "neighborhood_score"}``: the means over ``rows`` of their
    ``efficacy`` / ``paraphrase`` / ``neighborhood`` (rows without a score are left out; ``None`` if none has one)."""
    return {f"{name}_score": _mean([row[name] for row in rows]) for name in ("efficacy", "paraphrase", "neighborhood")}


def form_summary(rows: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, float | int | None]]:
    """Per prompt form (:mod:`editors.evaluation.forms`), over the :func:`case_row` rows that have it: ``{"score"``
    (the fraction of cases whose prompt in that form prefers ``target_new`` after the edit), ``"pre"`` (the same
    before), ``"n"`` (cases)``}``; forms in the order first met, ``{}`` when no case has form prompts."""
    names: dict[str, None] = {}
    for row in rows:
        names.update(dict.fromkeys(row.get("forms", {})))
    summary: dict[str, dict[str, float | int | None]] = {}
    for name in names:
        having = [row for row in rows if name in row.get("forms", {})]
        summary[name] = {"score": _mean([row["forms"][name] for row in having]),
                         "pre": _mean([row["pre"]["forms"][name] for row in having]), "n": len(having)}
    return summary
