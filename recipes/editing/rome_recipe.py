"""The ROME recipe: key → second-moment statistics → value via ``Trainer.fit`` → rank-one update → before/after.

:func:`run_rome` edits one fact with a :class:`editors.ROME` whose value runner is a
:class:`~recipes.editing.rome_value.LightningValueRunner`, measures the target probabilities and greedy generations
before and after the edit, and adds them to the value optimisation's TensorBoard run::

    runner = LightningValueRunner(logdir="runs", name="rome")
    rome = ROME(pg, tokenizer, "model.layers_3.mlp.down_proj", value_runner=runner)
    result = run_rome(rome, EditRequest("The {} is located in the city of", "Eiffel Tower", "Rome", "Paris"),
                      prompts=["The Eiffel Tower stands in the city of", "The Louvre is located in the city of"])
    result.edit.save("edits/eiffel")

The ``gradpatch rome`` command (:mod:`recipes.cli.rome`) and the demo (``demos/rome``) run it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from editors import DEFAULT_SMOLLM2_NODE, ROME, CounterFactCase, Edit, EditRequest, evaluate_cases
from editors.passes import mean_target_logprobs
from gradpatch.model_io import model_device

from ..errors import RecipeConfigError
from ..generation import greedy_generate
from ..reports.logger import generations_table

__all__ = ["ROMERun", "edit_node", "evaluate_rome", "rewrite_probabilities", "run_rome"]


@dataclass
class ROMERun:
    """Outcome of :func:`run_rome`.

    Attributes:
        edit: the applied edit (``edit.restore(pg)`` undoes it).
        prompts: the prompts generated from (the rewrite prompt first).
        before: greedy continuation of each prompt before the edit (new text only).
        after: the same after the edit.
        probabilities: ``{"before": {"new": p, "true": p}, "after": {...}}`` on the rewrite prompt; each ``p`` is
            ``exp`` of the mean token log-probability of ``" " + target`` (``"true"`` only when the request has a
            ``target_true``).
        log_dir: the TensorBoard run the value optimisation and these records went to (``None``: not logged).
        seconds: wall-clock seconds of ``statistics`` (load or compute C and the context prefixes), ``edit``
            (key, value optimisation, update) and ``generate`` (both sets of generations and probabilities).
    """

    edit: Edit
    prompts: list[str]
    before: list[str]
    after: list[str]
    probabilities: dict[str, dict[str, float]]
    log_dir: str | None
    seconds: dict[str, float] = field(default_factory=dict)


def edit_node(model_path: str | None, node: str | None) -> str:
    """The NodePath of the linear layer to edit: ``node``, or :data:`editors.defaults.DEFAULT_SMOLLM2_NODE` for the
    embedded model (``model_path`` ``None``).

    Raises:
        RecipeConfigError: another model without ``node`` (the message names NodePaths to give).
    """
    if node is not None:
        return node
    if model_path is not None:
        raise RecipeConfigError(
            "--model needs --node (node=) for a model other than the embedded one: the NodePath of the linear "
            "layer to edit, e.g. "
            "model.layers_4.mlp.down_proj (Llama) or transformer.h_17.mlp.c_proj (GPT-2 XL); "
            "`gradpatch graph --model PATH` prints the node tree")
    return DEFAULT_SMOLLM2_NODE


def rewrite_probabilities(pg: nn.Module, tokenizer: Any, request: EditRequest) -> dict[str, float]:
    """``{"new": p, "true": p}``: probabilities of the targets after the rewrite prompt (mean token log-prob, exp'd).

    ``"true"`` is left out when ``request.target_true`` is empty.
    """
    device = model_device(pg)
    targets = {"new": request.target_new, **({"true": request.target_true} if request.target_true else {})}
    logprobs = mean_target_logprobs(lambda ids: pg(ids.to(device), use_cache=False), tokenizer,
                                    [request.text] * len(targets), list(targets.values()))
    return {name: float(lp.exp()) for name, lp in zip(targets, logprobs)}


def run_rome(rome: ROME, request: EditRequest, prompts: Sequence[str] = (), max_new_tokens: int = 8) -> ROMERun:
    """Edit one fact with ROME and record its effect.

    Args:
        rome: the editor (its graph in ``eval()``; its ``value_runner`` a
            :class:`~recipes.editing.rome_value.LightningValueRunner` for TensorBoard records, any
            :class:`editors.value.ValueRunner` otherwise).
        request: the fact.
        prompts: more prompts to generate from (paraphrases, neighbours); the rewrite prompt comes first.
        max_new_tokens: tokens per greedy generation.

    Returns:
        A :class:`ROMERun`; the edit is applied.

    Raises:
        editors.errors.EditError, editors.errors.SubjectNotFoundError: as :meth:`editors.ROME.edit` (the weights are
            then unchanged).
    """
    pg, tokenizer = rome.pg, rome.tokenizer
    all_prompts = [request.text] + [p for p in prompts if p != request.text]
    t0 = time.perf_counter()
    rome.statistics()
    rome.templates()
    t1 = time.perf_counter()
    before = greedy_generate(pg, tokenizer, all_prompts, max_new_tokens, batch_size=1)
    p_before = rewrite_probabilities(pg, tokenizer, request)
    t2 = time.perf_counter()
    edit = rome.edit(request)
    t3 = time.perf_counter()
    after = greedy_generate(pg, tokenizer, all_prompts, max_new_tokens, batch_size=1)
    p_after = rewrite_probabilities(pg, tokenizer, request)
    t4 = time.perf_counter()
    log_dir = rome.last_value.log_dir if rome.last_value is not None else None
    result = ROMERun(edit=edit, prompts=all_prompts, before=before, after=after,
                     probabilities={"before": p_before, "after": p_after}, log_dir=log_dir,
                     seconds={"statistics": t1 - t0, "edit": t3 - t2, "generate": (t2 - t1) + (t4 - t3)})
    if log_dir is not None:
        from torch.utils.tensorboard import SummaryWriter

        with SummaryWriter(log_dir=log_dir) as writer:
            _log_edit(writer, result, step=int(edit.info.get("steps") or 0))
    return result


def _log_edit(writer: Any, run: ROMERun, step: int) -> None:
    """Generations before/after as a markdown table, the edit's summary as text, target probabilities as scalars."""
    table = generations_table(run.prompts, run.before, run.after, headers=("before the edit", "after the edit"))
    writer.add_text("generations", table, step)
    info = run.edit.info
    request = run.edit.request
    summary = [
        f"**{request.text}** → `{request.target_new}`" + (f" (was `{request.target_true}`)" if request.target_true else ""),
        "",
        f"- node: `{run.edit.node}`",
        f"- optimiser steps: {info.get('steps')}, final loss {info.get('loss'):.4f}",
        f"- ‖δ‖ = {info.get('delta_norm'):.3f}, ‖v₀‖ = {info.get('v_init_norm'):.3f}, ‖k*‖ = {info.get('key_norm'):.3f}",
    ]
    for when, probs in run.probabilities.items():
        summary.append(f"- P(target) {when}: " + ", ".join(f"{name} {p:.4f}" for name, p in probs.items()))
        for name, p in probs.items():
            writer.add_scalar(f"edit/p_{name}_{when}", p, step)
    writer.add_text("edit", "\n".join(summary), step)
    writer.flush()


def evaluate_rome(rome: ROME, cases: Sequence[CounterFactCase], progress: bool = True) -> dict[str, Any]:
    """CounterFact scores of ROME on ``cases``: each case edited on fresh weights, scored, restored.

    Args:
        rome: the editor.
        cases: CounterFact-format cases.
        progress: show a progress bar.

    Returns:
        ``{"efficacy_score", "paraphrase_score", "neighborhood_score", "n_cases", "pre", "node", "config",
        "statistics", "seconds", "cases"}`` (scores in [0, 1], ``pre``: the same scores before any edit, ``seconds``:
        ``statistics_and_templates`` and ``cases``) — the ``gradpatch eval-rome`` output.
    """
    t0 = time.perf_counter()
    stats = rome.statistics()
    rome.templates()
    t1 = time.perf_counter()
    metrics = evaluate_cases(rome.pg, rome.tokenizer, cases, rome.compute, progress=progress)
    t2 = time.perf_counter()
    return {
        "efficacy_score": metrics["efficacy_score"],
        "paraphrase_score": metrics["paraphrase_score"],
        "neighborhood_score": metrics["neighborhood_score"],
        "n_cases": metrics["n_cases"],
        "pre": metrics["pre"],
        "node": rome.node,
        "config": rome.config.to_json(),
        "statistics": {"n_tokens": stats.n_tokens, "n_samples": stats.n_samples, "corpus": stats.corpus},
        "seconds": {"statistics_and_templates": t1 - t0, "cases": t2 - t1},
        "cases": metrics["cases"],
    }
