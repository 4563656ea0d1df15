"""CounterFact evaluation of batched and sequential editing (MEMIT arXiv 2210.07229 §5, AlphaEdit arXiv 2410.02355 §4).

The cases are split into batches of ``batch_size`` facts and the batches into groups of ``sequential``. Within a
group, each batch is edited on the model as the earlier batches of the group left it (the sequential setting); once
the whole group is applied, every case of the group is scored, then the group's edits are restored (bit-identical
weights) and the next group starts from the original model. ``sequential = 1`` scores each batch on its own;
``batch_size = 1, sequential = 1`` is ``eval-rome``'s one fact at a time. Scores as :mod:`editors.evaluation.scores`:
efficacy, paraphrase and neighbourhood scores, means over cases, with the same scores on the unedited model (``pre``).

A neighbourhood prompt that names a subject edited in the same group ("The city of Benoni is located in" when Benoni
is itself rewritten) measures that subject's own edit, not whether unrelated facts were kept: it is left out of the
neighbourhood score, before and after the edits alike, and counted (``neighborhood_left_out`` per case,
``neighborhood_prompts_left_out`` in all). A case whose every neighbourhood prompt is left out has no neighbourhood
score and does not count in its mean.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from gradpatch.progress import ProgressBar

from ..edits.batch import BatchEdit
from ..edits.edit import Edit, restore_edits
from ..requests import EditRequest
from .counterfact import CounterFactCase
from .scores import EDIT_INFO_KEYS, case_row, form_summary, mentions_subject, score_cases, score_summary

__all__ = ["AppliedBatch", "BatchApplier", "batch_applier", "evaluate_cases", "evaluate_sequential", "rome_applier"]


@dataclass
class AppliedBatch:
    """A batch of facts written into the model.

    Attributes:
        undo: restores the weights as they were before the batch.
        facts: one record per request (value search steps, convergence, loss, target probability, ``‖δ‖``).
        info: JSON-able record of the batch (method, nodes, timings).
    """

    undo: Callable[[], None]
    facts: list[dict[str, Any]]
    info: dict[str, Any] = field(default_factory=dict)


#: ``requests -> AppliedBatch``: computes the batch's edit on the model as it is and applies it.
BatchApplier = Callable[[list[EditRequest]], AppliedBatch]


def rome_applier(pg: nn.Module, compute: Callable[[EditRequest], Edit]) -> BatchApplier:
    """A batch of ROME edits: each request computed (e.g. ``ROME.compute``) on the model with the batch's earlier
    edits applied, then applied (scored as computed, converged or not); undone in reverse order."""

    def apply(requests: list[EditRequest]) -> AppliedBatch:
        edits: list[Edit] = []
        try:
            for request in requests:
                edits.append(compute(request).apply(pg, allow_unconverged=True))
        except BaseException:
            restore_edits(pg, edits)
            raise
        return AppliedBatch(undo=lambda: restore_edits(pg, edits),
                            facts=[{k: e.info.get(k) for k in EDIT_INFO_KEYS} for e in edits],
                            info={"method": "rome", "nodes": sorted({e.node for e in edits})})

    return apply


def batch_applier(pg: nn.Module, edit: Callable[[list[EditRequest]], BatchEdit]) -> BatchApplier:
    """A batch edited at once: ``edit(requests)`` computes and applies a :class:`BatchEdit` (``MEMIT.edit``,
    ``AlphaEdit.edit``); undone with :meth:`BatchEdit.restore`."""

    def apply(requests: list[EditRequest]) -> AppliedBatch:
        batch = edit(requests)
        info = {k: v for k, v in batch.info.items() if k not in ("facts", "config")}
        return AppliedBatch(undo=lambda: batch.restore(pg), facts=list(batch.info.get("facts", [])), info=info)

    return apply


def evaluate_sequential(
    pg: nn.Module,
    tokenizer: Any,
    cases: Sequence[CounterFactCase],
    apply_batch: BatchApplier,
    batch_size: int = 1,
    sequential: int = 1,
    after_group: Callable[[], None] | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Edit the cases in batches, groups of ``sequential`` batches at a time, and score each group after all its
    batches are applied.

    Args:
        pg: the model's PatchableGraph.
        tokenizer: its tokenizer.
        cases: CounterFact cases.
        apply_batch: computes and applies one batch (:func:`rome_applier`, :func:`batch_applier`).
        batch_size: facts per batch (≥ 1).
        sequential: batches applied one after another before scoring (≥ 1).
        after_group: called after a group's edits were undone (e.g. ``AlphaEdit.forget``).
        progress: show a progress bar and print one line per batch and per group.

    Returns:
        ``{"efficacy_score", "paraphrase_score", "neighborhood_score", "n_cases", "pre", "batch_size", "sequential",
        "batches", "seconds_per_batch", "cases", "neighborhood_prompts_left_out", "forms"}``: ``pre`` the scores
        before any edit; ``forms`` the scores per prompt form of the cases' ``form_prompts``
        (:func:`~editors.evaluation.scores.form_summary`, ``{}`` without any); ``batches`` one record per batch
        (group, facts, seconds, the editor's record); each case row as :func:`~editors.evaluation.scores.case_row`
        writes it, with its batch, group and ``neighborhood_left_out`` (above). The
        weights end as they began.

    Raises:
        ValueError: ``batch_size`` or ``sequential`` below 1.
    """
    if batch_size < 1 or sequential < 1:
        raise ValueError(f"batch_size and sequential must be at least 1, got {batch_size} and {sequential}")
    pre = score_cases(pg, tokenizer, cases)
    batches = [list(range(i, min(i + batch_size, len(cases)))) for i in range(0, len(cases), batch_size)]
    records: list[dict[str, Any]] = []
    rows: list[dict[str, Any]] = [{} for _ in cases]
    with ProgressBar("batches", unit="batch", total=len(batches), enabled=progress) as bar:
        for g in range(0, len(batches), sequential):
            group = batches[g : g + sequential]
            applied: list[AppliedBatch] = []
            try:
                for b, members in enumerate(group, start=g):
                    t0 = time.perf_counter()
                    done = apply_batch([cases[i].request for i in members])
                    applied.append(done)
                    records.append({"batch": b, "group": g // sequential, "n_facts": len(members),
                                    "seconds": time.perf_counter() - t0, **done.info})
                    for i, fact in zip(members, done.facts):
                        rows[i] = {"batch": b, "group": g // sequential, "edit": fact}
                    if progress:
                        bar.note(f"batch {b + 1}/{len(batches)} ({len(members)} facts): {records[-1]['seconds']:.1f} s")
                    bar.advance()
                members = [i for batch in group for i in batch]
                post = score_cases(pg, tokenizer, [cases[i] for i in members])
                edited = mentions_subject(cases[i].request.subject for i in members)
            finally:
                for done in reversed(applied):
                    done.undo()
                if after_group is not None:
                    after_group()
            for i, scores in zip(members, post):
                keep = [not edited(prompt) for prompt in cases[i].neighborhood_prompts]
                rows[i] = {**case_row(cases[i], pre[i], scores, keep), "neighborhood_left_out": keep.count(False),
                           **rows[i]}
            if progress:
                summary = score_summary([rows[i] for i in members])
                bar.note(f"group {g // sequential + 1}: " + ", ".join(f"{k} {v:.3f}" for k, v in summary.items()
                                                                     if v is not None))
    return {**score_summary(rows), "n_cases": len(rows), "pre": score_summary([r["pre"] for r in rows]),
            "forms": form_summary(rows),
            "neighborhood_prompts_left_out": sum(r["neighborhood_left_out"] for r in rows), "batch_size": batch_size,
            "sequential": sequential, "batches": records, "seconds_per_batch": [r["seconds"] for r in records],
            "cases": rows}


def evaluate_cases(pg: nn.Module, tokenizer: Any, cases: Sequence[CounterFactCase],
                   compute_edit: Callable[[EditRequest], Edit], progress: bool = True) -> dict[str, Any]:
    """Edit and score each case on fresh weights, restoring after each: :func:`evaluate_sequential` with
    ``batch_size=1`` and :func:`rome_applier` (one CounterFact loop; the unedited model's scores are taken for all
    cases together, docs/architecture.md, "eval-rome").

    Args:
        pg: the model's PatchableGraph.
        tokenizer: its tokenizer.
        cases: CounterFact cases.
        compute_edit: request -> :class:`Edit` (not applied), e.g. ``ROME(pg, tok, node).compute``.
        progress: show a progress bar and print one line per case.

    Returns:
        ``{"efficacy_score", "paraphrase_score", "neighborhood_score", "n_cases", "pre": {...}, "cases": [...]}``
        where ``pre`` holds the same scores on the unedited model and each case row holds ``pre``/``post``
        scores, the edit's info (steps, whether its value search converged, loss, norms, timings), ``seconds`` (the
        edit's computation and application) and :func:`evaluate_sequential`'s ``batch``, ``group`` and
        ``neighborhood_left_out``. Edits are scored whether or not their value search converged: the scores measure
        the editor as it is.
    """
    result = evaluate_sequential(pg, tokenizer, cases, rome_applier(pg, compute_edit), progress=progress)
    seconds = {record["batch"]: record["seconds"] for record in result["batches"]}
    return {key: result[key] for key in ("efficacy_score", "paraphrase_score", "neighborhood_score", "n_cases",
                                         "pre")} | {"cases": [row | {"seconds": seconds[row["batch"]]}
                                                              for row in result["cases"]]}
