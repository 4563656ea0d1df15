"""A value-search term that keeps the true answer's logit: the edit may raise the new answer, not push the old one down.

Not in the papers. ROME's value objective (Meng et al. 2022, §3.1, eq. 4), which MEMIT (Meng et al. 2023, §4.3,
eq. 16) and AlphaEdit (Fang et al. 2025) use for every fact of a batch, asks only for the new target's likelihood, and
it gets there partly by lowering the true answer. The values ``δ`` of facts that share a true answer (cities of one
country) then share a part that removes that answer from other subjects, those parts add up over a batch while the new
targets differ, and the update carries the sum to every key near the edited ones: the neighbours lose their own
answer (docs/memit.md, "The shared part of one country's values"). :class:`TrueAnswerTerm` adds, per fact,

    λ_true · 1/N Σ_j max(0, z_true,j(0) − z_true,j(δ))

to the fact's loss: ``z_true,j`` the logit (before the softmax) of the first token of ``target_true`` at the position
that predicts the first target token of rewriting prompt ``j``, ``z_true,j(0)`` its value at ``δ = 0`` (kept from the
fact's first evaluation). The edit must then beat the true answer by raising the new one. On 3 sequential batches of 100
development facts, AlphaEdit's neighbourhood score rose from 0.892 to 0.956 at λ_true = 0.5 (efficacy −0.020); on 10
batches of 100 evaluation facts, from 0.777 to 0.925 (efficacy −0.081; docs/memit.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..config import check_true_logit_weight
from ..errors import TokenizationError
from ..passes.tokens import encode_prompt_target, format_with_span
from ..requests import EditRequest

__all__ = ["TrueAnswerTerm"]


class TrueAnswerTerm:
    """Each fact's mean hinged drop of its true-answer logit over its rewriting prompts (see the module); the objective
    adds :attr:`weight` (``λ_true``) times it to the fact's loss.

    Args:
        tokenizer: the model's tokenizer.
        requests: the ``F`` facts, each with ``target_true``.
        weight: ``λ_true`` (≥ 0; :class:`~editors.value.batch_objective.BatchValueObjective` builds the term only
            for a positive weight).

    Raises:
        ValueError: ``weight`` is negative (:func:`editors.config.check_true_logit_weight`), or a request has no ``target_true`` (the message names it).
        TokenizationError: a request's true answer cannot be tokenized after its prompt (named).
    """

    def __init__(self, tokenizer: Any, requests: Sequence[EditRequest], weight: float) -> None:
        check_true_logit_weight(weight)
        self.weight = weight
        token_ids = []
        for i, request in enumerate(requests):
            if not request.target_true:
                raise ValueError(f"Request {i} (subject {request.subject!r}) has no target_true; the true-answer term "
                                 f"needs it (or set true_logit_weight=0)")
            text, _ = format_with_span(request.prompt, request.subject)
            try:
                encoded = encode_prompt_target(tokenizer, text, request.target_true)
            except TokenizationError as error:
                raise TokenizationError(f"Request {i} (subject {request.subject!r}), target_true: {error}") from None
            token_ids.append(encoded.ids[encoded.target_start])
        self.token_ids = torch.tensor(token_ids)  # [F]: first token of each fact's true answer
        self._reference: list[torch.Tensor | None] = [None] * len(token_ids)  # [prompts of the fact] per fact

    def read_tokens(self, facts: Sequence[int], read_fact: torch.Tensor) -> torch.Tensor:
        """``[n]``: the true-answer token whose logit to read at each target-token read, given each read's slot in
        ``facts`` (``read_fact``, ``[n]``)."""
        ids = self.token_ids.to(read_fact.device)[torch.tensor(list(facts), device=read_fact.device)]
        return ids[read_fact]

    def drop(self, facts: Sequence[int], true_logits: torch.Tensor, token_prompt: torch.Tensor,
             prompt_fact: torch.Tensor) -> torch.Tensor:
        """Each fact's mean hinged drop of its true-answer logit over its rewriting prompts, ``[len(facts)]``
        (differentiable). A fact's first evaluation sets its reference; the caller makes it one at ``δ = 0``
        (:class:`editors.value.batch_objective.BatchValueObjective` refuses any other, as it does for the KL reference).

        Args:
            facts: the facts evaluated, in slot order.
            true_logits: ``[n]`` the true answer's logit at every target-token read, in read order (each prompt's
                reads in order, prompts in order).
            token_prompt: ``[n]`` the prompt of each read; prompt_fact: ``[P]`` the slot of each prompt.
        """
        first = torch.ones_like(token_prompt, dtype=torch.bool)
        first[1:] = token_prompt[1:] != token_prompt[:-1]
        at_first = true_logits.new_zeros(len(prompt_fact)).index_add(0, token_prompt[first], true_logits[first])  # [P]
        counts = torch.bincount(prompt_fact, minlength=len(facts))
        references = []
        for fact, part in zip(facts, at_first.split(counts.tolist())):
            if self._reference[fact] is None:
                self._reference[fact] = part.detach()
            references.append(self._reference[fact])
        hinge = torch.relu(torch.cat(references) - at_first)  # [P]
        return hinge.new_zeros(len(facts)).index_add(0, prompt_fact, hinge) / counts.to(hinge.dtype)
