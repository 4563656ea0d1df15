"""Scoring continuations: mean log-probability of target tokens after a prompt.

A *forward* here is any callable mapping ``input_ids [batch, seq]`` to logits ``[batch, seq, vocab]`` (or to a
model output with ``.logits``): a Hugging Face model, a :class:`gradpatch.PatchableGraph`, or either inside a
``pg.patch(...)`` block.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from gradpatch.model_io import logits_of, pad_token_id, right_pad

from .tokens import EncodedPrompt, encode_prompt_target

__all__ = ["Forward", "SelectedForward", "mean_target_logprobs", "target_logprobs_batch"]

#: ``input_ids [batch, seq] -> logits [batch, seq, vocab]`` (or a model output holding ``.logits``).
Forward = Callable[[torch.Tensor], Any]
#: ``(input_ids [batch, seq], rows [n], cols [n]) -> logits [n, vocab]`` at those positions only
#: (:func:`editors.passes.selected_logits.logits_at`).
SelectedForward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def target_logprobs_batch(logits: torch.Tensor, encoded: Sequence[EncodedPrompt]) -> torch.Tensor:
    """Mean log-probability of each example's target tokens.

    Args:
        logits: ``[batch, seq, vocab]`` for the right-padded batch of ``encoded``.
        encoded: ``batch`` prompts with ``target_start`` set.

    Returns:
        ``[batch]``: ``mean_t log p(target_t | prompt, target_<t)``; differentiable w.r.t. ``logits``.
    """
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    rows = []
    for b, enc in enumerate(encoded):
        positions = torch.arange(enc.target_start, len(enc.ids), device=logits.device)
        tokens = torch.tensor(enc.ids[enc.target_start :], device=logits.device)
        rows.append(log_probs[b, positions - 1, tokens].mean())
    return torch.stack(rows)


@torch.no_grad()
def mean_target_logprobs(
    forward: Forward,
    tokenizer: Any,
    prompts: Sequence[str],
    targets: Sequence[str],
    batch_size: int = 32,
    forward_at: SelectedForward | None = None,
) -> torch.Tensor:
    """Score ``prompt + " " + target`` pairs: mean token log-probability of each target.

    Args:
        forward: ``input_ids [batch, seq] -> logits`` (model, PatchableGraph, ...).
        tokenizer: the model's tokenizer.
        prompts: ``n`` prompts without trailing space.
        targets: ``n`` targets without leading space (CounterFact convention).
        batch_size: examples per forward pass (right-padded, no attention mask needed).
        forward_at: when given, used instead of ``forward`` for logits at the target tokens' positions only (the
            output embedding and the softmax skip every other position); same scores up to float rounding.

    Returns:
        ``[n]`` float32 tensor of mean log-probabilities.

    Raises:
        ValueError: ``prompts`` and ``targets`` differ in length.
    """
    if len(prompts) != len(targets):
        raise ValueError(f"{len(prompts)} prompts but {len(targets)} targets: give one target per prompt")
    encoded = [encode_prompt_target(tokenizer, p, t) for p, t in zip(prompts, targets)]
    pad = pad_token_id(tokenizer)
    out = []
    for i in range(0, len(encoded), batch_size):
        chunk = encoded[i : i + batch_size]
        ids, _ = right_pad([e.ids for e in chunk], pad)
        if forward_at is None:
            out.append(target_logprobs_batch(logits_of(forward(ids)), chunk).cpu())
        else:
            out.append(_selected_target_logprobs(forward_at, ids, chunk).cpu())
    return torch.cat(out) if out else torch.zeros(0)


def _selected_target_logprobs(forward_at: SelectedForward, ids: torch.Tensor,
                              encoded: Sequence[EncodedPrompt]) -> torch.Tensor:
    """:func:`target_logprobs_batch` of ``encoded`` (right-padded into ``ids``) from logits at the target tokens'
    positions only: ``[batch]``."""
    rows = torch.tensor([b for b, e in enumerate(encoded) for _ in range(e.target_start, len(e.ids))])
    cols = torch.tensor([t - 1 for e in encoded for t in range(e.target_start, len(e.ids))])
    tokens = torch.tensor([e.ids[t] for e in encoded for t in range(e.target_start, len(e.ids))])
    logits = forward_at(ids, rows, cols)  # [n_target_tokens, vocab]
    rows, tokens = rows.to(logits.device), tokens.to(logits.device)
    token_lp = torch.log_softmax(logits.float(), dim=-1)[torch.arange(len(tokens), device=logits.device), tokens]
    counts = torch.tensor([e.n_target for e in encoded], dtype=torch.float32, device=logits.device)
    return token_lp.new_zeros(len(encoded)).index_add(0, rows, token_lp) / counts
