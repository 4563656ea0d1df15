"""The value ``v*`` (Meng et al. 2022, section 3.1, eq. 4): the layer output that makes the model say the new fact.

With the subject's layer output shifted by ``δ`` (an :class:`gradpatch.AddPatch` at the layer's ``output`` node,
at the subject's last token of every prompt), ROME minimises::

    L(δ) = 1/N Σ_j  -1/|o| Σ_t log P(o_t | x_j + p, o_<t)                 (target NLL over context prompts)
           + λ_KL · KL( P(· | "{s} is a", δ) ‖ P(· | "{s} is a", δ=0) )     (essence drift, λ_KL = 0.0625)
           + λ_wd · ‖δ‖ / ‖v₀‖²                                              (weight decay, as the reference code)

with ``‖δ‖ ≤ clamp_factor · ‖v₀‖`` enforced after each step (``v₀ = W k* + b``, the output at the averaged
key), and ``v* = v₀ + δ``. Given the update's direction ``u`` (ROME's default), ``δ`` instead enters through the
rank-one update itself, ``(uᵀ k) δ`` at every token (the model with ``W + δ uᵀ``), so the search optimises what the edit
will do. :class:`ValueObjective` computes the terms (``loss(delta) -> dict``); a
:class:`ValueRunner` minimises it. Two runners share that one objective: :func:`optimize_value`, the plain-torch
loop (Adam, early stop when ``loss < 0.05``; the batched search's loop, :func:`editors.value.loop.search_values`, run
on a batch of one) that ``editors`` uses when nothing else is given, and
``recipes.rome_value.LightningValueRunner``, the same loop as a LightningModule under ``Trainer.fit`` (used by the
``gradpatch rome`` command and the demo, with TensorBoard logging). Both stop at the first
non-finite loss term, gradient or updated ``δ`` with a :class:`gradpatch.errors.NonFiniteError` naming the step
(:func:`value_step_guard`), and :meth:`ValueResult.converged` tells whether the search converged.

The prompts of one fact (:func:`encode_value_prompts`) and the terms computed from log-probabilities
(:func:`value_terms`, vectorised over facts) are shared with the batched search of many facts
(:mod:`editors.value.batch_objective`), so both minimise the same objective.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from gradpatch import AddPatch
from gradpatch.finite import StepGuard
from gradpatch.model_io import model_device, pad_token_id, right_pad

from ..edits.patches import layer_patches
from ..layers import LinearLayer
from ..passes.selected_logits import logits_at, output_embedding_input_node
from ..passes.token_log_probs import token_log_probs
from ..passes.tokens import EncodedPrompt, encode_prompt_target, encode_subject_prompt, format_with_span
from ..requests import EditRequest
from ..statistics.keys import ContextPrefixes
from .loop import ValueResult, ValueSearch, frozen_parameters, run_search

__all__ = ["StepCallback", "ValueObjective", "ValuePrompts", "ValueResult", "ValueRunner", "encode_value_prompts",
           "frozen_parameters", "kl_context_prefix", "one_fact_search", "optimize_value", "value_step_guard",
           "value_terms"]

KL_PROMPT = "{} is a"


@dataclass(frozen=True)
class ValuePrompts:
    """The token sequences of one fact's value objective (eq. 4) and the positions its terms read.

    Attributes:
        rewrite: the ``N`` rewriting prompts (context prefix + prompt + target), encoded.
        sequences: the model inputs: each rewriting prompt without its last target token, then the KL prompts.
        subject_positions: per sequence, the index of the subject's last token (where ``δ`` is added).
        targets: ``(sequence, column, token)`` for every target token of every rewriting prompt; the logits at
            ``column`` (the position before the token) predict it.
    """

    rewrite: list[EncodedPrompt]
    sequences: list[list[int]]
    subject_positions: list[int]
    targets: list[tuple[int, int, int]]

    @property
    def n_kl(self) -> int:
        """Number of KL prompts (the sequences after the rewriting ones)."""
        return len(self.sequences) - len(self.rewrite)


def encode_value_prompts(tokenizer: Any, request: EditRequest, templates: ContextPrefixes,
                         kl_prompts: tuple[str, ...] = (KL_PROMPT,), kl_prefix: str = "") -> ValuePrompts:
    """Tokenize one fact's rewriting prompts (one per context prefix) and KL prompts (eq. 4), the KL prompts behind
    ``kl_prefix`` (``""``: the text begins with the subject, the paper's).

    Raises:
        SubjectNotFoundError: the subject does not fill the prompt's ``"{}"``.
        TokenizationError: the target is empty or a token straddles the prompt/target boundary.
    """
    rewrite: list[EncodedPrompt] = []
    for prefix in templates.prefixes:
        text, span = format_with_span(request.prompt, request.subject, prefix)
        rewrite.append(encode_prompt_target(tokenizer, text, request.target_new, subject_span=span))
    essence = []
    for template in kl_prompts:
        text, span = format_with_span(template, request.subject, kl_prefix)
        essence.append(encode_subject_prompt(tokenizer, text, span))
    targets = [(b, t - 1, e.ids[t]) for b, e in enumerate(rewrite) for t in range(e.target_start, len(e.ids))]
    return ValuePrompts(rewrite=rewrite, sequences=[e.ids[:-1] for e in rewrite] + [e.ids for e in essence],
                        subject_positions=[e.subject_last for e in rewrite + essence], targets=targets)


def kl_context_prefix(templates: ContextPrefixes, in_context: bool) -> str:
    """The text the KL prompts are read behind: ``""`` (the paper's: the text begins with the subject), or with
    ``in_context`` the first non-empty context prefix (the same in every subset of the prefixes that keeps more than
    the empty one, :meth:`ContextPrefixes.subset`).

    Raises:
        ValueError: ``in_context`` and no non-empty prefix among ``templates``.
    """
    if not in_context:
        return ""
    nonempty = [prefix for prefix in templates.prefixes if prefix]
    if not nonempty:
        raise ValueError("kl_in_context needs a non-empty context prefix among the value search's: give "
                         "value_prefixes >= 2 and context_length_params a (tokens, count) pair with count >= 1, or set "
                         "kl_in_context=False")
    return nonempty[0]


def value_terms(per_prompt_lp: torch.Tensor, prompt_fact: torch.Tensor, kl_lp: torch.Tensor,
                kl_reference: torch.Tensor, kl_fact: torch.Tensor, delta: torch.Tensor, v_init: torch.Tensor,
                kl_factor: float, weight_decay: float) -> dict[str, torch.Tensor]:
    """The terms of eq. 4 for ``F`` facts at once, each fact's from its own rows only.

    Args:
        per_prompt_lp: ``[P]`` mean target-token log-probability of each rewriting prompt.
        prompt_fact: ``[P]`` the fact (``0..F-1``) each prompt belongs to.
        kl_lp: ``[Q, vocab]`` next-token log-probabilities after each KL prompt, at the current ``δ``.
        kl_reference: ``[Q, vocab]`` the same at ``δ = 0``.
        kl_fact: ``[Q]`` the fact each KL prompt belongs to.
        delta: ``[F, d_out]``; v_init: ``[F, d_out]`` (``v₀ = W k* + b`` per fact).
        kl_factor: λ_KL; weight_decay: λ_wd.

    Returns:
        ``{"loss", "nll", "kl", "weight_decay", "target_prob"}``, each ``[F]``: ``nll`` the mean over the fact's
        prompts of ``-per_prompt_lp``, ``kl`` the mean over its KL prompts of ``KL(P(·|δ) ‖ P(·|0))``, weight decay
        ``λ_wd ‖δ‖ / ‖v₀‖²``, ``loss = nll + λ_KL kl + weight decay``; ``target_prob`` (detached) the mean over its
        prompts of ``exp(per_prompt_lp)``.
    """
    n_facts = delta.shape[0]
    zeros = per_prompt_lp.new_zeros(n_facts)
    n_prompts = zeros.index_add(0, prompt_fact, torch.ones_like(per_prompt_lp))
    nll = -zeros.index_add(0, prompt_fact, per_prompt_lp) / n_prompts
    kl_rows = torch.nn.functional.kl_div(kl_reference, kl_lp, log_target=True, reduction="none").sum(-1)  # [Q]
    kl = zeros.index_add(0, kl_fact, kl_rows) / zeros.index_add(0, kl_fact, torch.ones_like(kl_rows))
    decay = weight_decay * delta.norm(dim=-1) / v_init.norm(dim=-1).clamp_min(1e-12) ** 2
    target_prob = zeros.index_add(0, prompt_fact, per_prompt_lp.detach().exp()) / n_prompts
    return {"loss": nll + kl_factor * kl + decay, "nll": nll, "kl": kl, "weight_decay": decay,
            "target_prob": target_prob}


class ValueObjective:
    """The loss of eq. 4 as a function of the delta ``δ`` ``[d_out]`` added at the subject's last token.

    One right-padded batch holds the ``N`` rewriting prompts (context prefix + prompt + target tokens but the
    last) followed by the KL prompt ``"{subject} is a"``; one forward pass gives every term, with the output
    embedding run only at the positions the terms read (the target tokens, the KL prompt's last token) and the
    target log-probabilities taken without a float32 log-softmax of every logit (:mod:`editors.passes.token_log_probs`).

    Args:
        pg: the model's PatchableGraph.
        tokenizer: its tokenizer.
        layer: the edited layer.
        request: the fact (``prompt``, ``subject``, ``target_new``).
        templates: context prefixes.
        v_init: ``v₀ = W k* + b`` ``[d_out]`` (norm reference for weight decay and the clamp).
        kl_factor: λ_KL (0.0625).
        weight_decay: λ_wd (1e-3; the reference code uses 0.5 for GPT-2 XL and 1e-3 for Llama).
        clamp_factor: maximum ``‖δ‖ / ‖v₀‖`` (4).
        kl_prompts: templates of the essence prompts (default ``["{} is a"]``).
        kl_in_context: read the KL prompts behind the first non-empty prefix of ``templates``
            (:func:`kl_context_prefix`, :attr:`editors.config.ROMEConfig.kl_in_context`); ``False``: at the start of
            the text (the paper's).
        direction: ``u`` ``[d_in]`` of the rank-one update the edit will write (eq. 2, ``W' = W + δ uᵀ``): ``δ``
            then enters every forward pass through that update, changing the output at every token of every prompt
            by ``(uᵀ k) δ`` for the token's key ``k``, exactly as the applied edit will. ``None``: ``δ`` is added at
            the subject's last token of every prompt (the paper's search), which assumes ``uᵀ k = 1`` there; where a
            prompt's key is far from ``k*`` (a subject right after the start token: ``uᵀ k`` was 0.34 for "Kyoto is
            located in the country of", 0.21 for "Cristiano Ronaldo is a professional", docs/rome.md) the search then
            met its target on a prompt the edit moves by a third of ``δ``.

    Raises:
        ValueError: ``kl_in_context`` and no non-empty prefix among ``templates``.
        SubjectNotFoundError, TokenizationError: the request cannot be encoded (:func:`encode_value_prompts`).
    """

    def __init__(
        self,
        pg: nn.Module,
        tokenizer: Any,
        layer: LinearLayer,
        request: EditRequest,
        templates: ContextPrefixes,
        v_init: torch.Tensor,
        kl_factor: float = 0.0625,
        weight_decay: float = 1e-3,
        clamp_factor: float = 4.0,
        kl_prompts: tuple[str, ...] = (KL_PROMPT,),
        kl_in_context: bool = False,
        direction: torch.Tensor | None = None,
    ) -> None:
        self.pg, self.layer, self.request = pg, layer, request
        self.direction = None if direction is None else direction.detach()
        self.kl_factor, self.weight_decay, self.clamp_factor = kl_factor, weight_decay, clamp_factor
        self.v_init = v_init.detach()
        self.device = model_device(pg)
        prompts = encode_value_prompts(tokenizer, request, templates, kl_prompts,
                                       kl_context_prefix(templates, kl_in_context))
        self.rewrite = prompts.rewrite
        ids, lengths = right_pad(prompts.sequences, pad_token_id(tokenizer))
        self.input_ids = ids.to(self.device)  # [N + n_kl, seq]
        n = len(prompts.rewrite)
        self.patch_index = (
            torch.arange(len(prompts.sequences), device=self.device),
            torch.tensor(prompts.subject_positions, device=self.device),
        )
        rows, cols, tokens = zip(*prompts.targets)
        self.target_rows = torch.tensor(rows, device=self.device)
        self.target_cols = torch.tensor(cols, device=self.device)
        self.target_tokens = torch.tensor(tokens, device=self.device)
        self.target_counts = torch.tensor([e.n_target for e in prompts.rewrite], device=self.device,
                                          dtype=torch.float32)
        self.kl_rows = torch.arange(n, len(prompts.sequences), device=self.device)
        self.kl_cols = (lengths[n:] - 1).to(self.device)
        self.read_rows = torch.cat([self.target_rows, self.kl_rows])  # positions the terms read logits at
        self.read_cols = torch.cat([self.target_cols, self.kl_cols])
        self.head_node = output_embedding_input_node(pg)
        self.kl_reference: torch.Tensor | None = None  # log P(· | "{s} is a") with δ = 0, [n_kl, vocab]

    @property
    def max_norm(self) -> float:
        """``clamp_factor · ‖v₀‖``."""
        return float(self.clamp_factor * self.v_init.norm())

    def _logits(self, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits at the target tokens' positions ``[n_target_tokens, vocab]`` and at the KL prompts' last positions
        ``[n_kl, vocab]`` (the output embedding runs there only: :func:`editors.passes.selected_logits.logits_at`)."""
        if self.direction is None:
            patches: dict[str, Any] = {self.layer.output_node: AddPatch(value=delta, slice=self.patch_index)}
        else:  # through the rank-one update: (uᵀ k) δ at every token, as W + δ uᵀ (an expert: w_e (uᵀ k_e) δ)
            patches = layer_patches(self.layer, self.direction, delta)
        logits = logits_at(self.pg, self.input_ids, self.read_rows, self.read_cols, patches, head_node=self.head_node)
        targets, kl = logits.split([len(self.target_tokens), len(self.kl_rows)])
        return targets, kl

    def loss(self, delta: torch.Tensor) -> dict[str, torch.Tensor]:
        """All loss terms for ``δ`` (differentiable w.r.t. ``delta``).

        The KL reference distribution is taken from the first call if ``δ`` is zero there (as in the reference
        code, which saves one forward pass), else from an extra no-grad pass with ``δ = 0``.

        Args:
            delta: ``[d_out]`` tensor (an ``nn.Parameter`` during optimisation).

        Returns:
            ``{"loss", "nll", "kl", "weight_decay", "target_prob"}``: scalars; ``target_prob`` is the mean over
            prompts of ``exp(mean log P(target tokens))`` (detached).
        """
        if self.kl_reference is None and bool(delta.detach().abs().max() > 0):
            with torch.no_grad():
                self._set_kl_reference(self._logits(torch.zeros_like(delta))[1])
        target_logits, kl_logits = self._logits(delta)
        token_lp = token_log_probs(target_logits, self.target_tokens)  # [n_target_tokens]
        per_prompt = torch.zeros_like(self.target_counts).index_add(0, self.target_rows, token_lp) / self.target_counts
        kl_lp = torch.log_softmax(kl_logits.float(), dim=-1)  # [n_kl, vocab]
        if self.kl_reference is None:
            self._set_kl_reference(kl_logits)
        prompt_fact = torch.zeros(len(per_prompt), dtype=torch.long, device=per_prompt.device)
        kl_fact = torch.zeros(len(kl_lp), dtype=torch.long, device=per_prompt.device)
        terms = value_terms(per_prompt, prompt_fact, kl_lp, self.kl_reference, kl_fact, delta.unsqueeze(0),
                            self.v_init.unsqueeze(0), self.kl_factor, self.weight_decay)
        return {name: value[0] for name, value in terms.items()}

    def _set_kl_reference(self, kl_logits: torch.Tensor) -> None:
        self.kl_reference = torch.log_softmax(kl_logits.detach().float(), dim=-1)

    @torch.no_grad()
    def project_(self, delta: torch.Tensor) -> None:
        """Clamp ``‖δ‖ ≤ clamp_factor · ‖v₀‖`` in place (after each optimiser step)."""
        norm = delta.norm()
        if norm > self.max_norm:
            delta.mul_(self.max_norm / norm)


def value_step_guard(lr: float) -> StepGuard:
    """How both value runners report a non-finite loss term, gradient or ``δ`` (steps counted from 0)."""
    return StepGuard("ROME value step", f"lower the learning rate (lr={lr:g}) or keep the norm clamp (clamp_factor); "
                                        f"the weights were not changed")


#: ``callback(step, terms)``: called after each loss evaluation with the terms as floats.
StepCallback = Callable[[int, dict[str, float]], None]


class ValueRunner(Protocol):
    """Minimises a :class:`ValueObjective` over ``δ`` (Adam from ``δ = 0``, :meth:`ValueObjective.project_` after each
    step, stop before stepping once ``loss < early_stop_loss``) and returns the :class:`ValueResult`."""

    def __call__(self, objective: "ValueObjective", *, steps: int, lr: float, early_stop_loss: float,
                 callback: StepCallback | None = None) -> "ValueResult": ...


def optimize_value(
    objective: ValueObjective,
    *,
    steps: int = 25,
    lr: float = 0.5,
    early_stop_loss: float = 0.05,
    callback: StepCallback | None = None,
) -> ValueResult:
    """Minimise :meth:`ValueObjective.loss` over ``δ`` with Adam: the plain-torch :class:`ValueRunner`.

    The model's parameters are frozen for the duration (only ``δ`` gets gradients), and restored after.

    Args:
        objective: the loss.
        steps: maximum optimiser steps (25).
        lr: Adam learning rate (0.5).
        early_stop_loss: stop before stepping once ``loss`` is below this (0.05).
        callback: called with ``(step, terms)`` after each evaluation.

    Returns:
        A :class:`ValueResult`.

    Raises:
        ValueError: ``lr`` is not a finite positive number.
        NonFiniteError: a loss term, the gradient of ``δ`` or ``δ`` after an update is NaN or inf (the message names
            the step and the terms), or the update overflows (a learning rate such as 1e38).
    """
    return run_search(one_fact_search(objective, lr=lr, early_stop_loss=early_stop_loss, callback=callback), steps)[0]


def one_fact_search(objective: ValueObjective, *, lr: float, early_stop_loss: float,
                    callback: StepCallback | None = None, backward: Callable[[torch.Tensor], None] | None = None,
                    optimizer_step: Callable[[], object] | None = None) -> ValueSearch:
    """The :class:`~editors.value.loop.ValueSearch` of one fact (the batch of one, ``δ`` ``[1, d_out]``) that both
    :class:`ValueRunner` s run: :func:`optimize_value` and ``recipes.rome_value.LightningValueRunner``.

    Args:
        objective: the fact's loss (a :class:`ValueObjective`, or any object with its ``pg``, ``v_init``
            ``[d_out]``, ``loss(δ)`` and ``project_(δ)``).
        lr, early_stop_loss: as :func:`optimize_value`.
        callback: called with ``(step, terms)`` after each evaluation.
        backward, optimizer_step: as :class:`~editors.value.loop.ValueSearch`.

    Raises:
        ValueError: ``lr`` is not a finite positive number.
    """
    batch_callback = None if callback is None else (lambda step, terms: callback(step, terms[0]))
    return ValueSearch(_OneFact(objective), lr=lr, early_stop_loss=early_stop_loss,
                       guard=lambda fact: value_step_guard(lr), callback=batch_callback, backward=backward,
                       optimizer_step=optimizer_step)


class _OneFact:
    """A :class:`ValueObjective` (or any ``loss(δ)`` / ``project_(δ)`` objective of one fact) as the batch of one that
    :func:`editors.value.loop.search_values` minimises: ``δ`` ``[1, d_out]``, every term ``[1]``."""

    def __init__(self, objective: ValueObjective) -> None:
        self.objective = objective
        self.pg = objective.pg
        self.v_init = objective.v_init.unsqueeze(0)

    def chunks(self, facts: Sequence[int]) -> list[list[int]]:
        return [list(facts)]

    def loss(self, delta: torch.Tensor, facts: Sequence[int]) -> dict[str, torch.Tensor]:
        return {name: value.unsqueeze(0) for name, value in self.objective.loss(delta[0]).items()}

    def project_(self, delta: torch.Tensor) -> None:
        self.objective.project_(delta[0])

    def release(self, facts: Sequence[int]) -> None:
        return None
