"""Greedy generation through a PatchableGraph, with the call convention of the delta recipes.

The recipes call the graph as ``pg(input_ids, attention_mask=..., position_ids=..., use_cache=False)`` on
left-padded batches. Generating the same way (the whole sequence at every step, no cache) keeps to graphs already
extracted, and a delta at the last position acts on the newest token at every step, as it was trained.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from editors.layers import model_device
from editors.scoring import logits_of

from .data import encode, left_pad, pad_token_id

__all__ = ["graph_logits", "greedy_generate"]


def graph_logits(pg: nn.Module, batch: dict[str, torch.Tensor], constants: dict[str, Any] | None = None) -> torch.Tensor:
    """Logits of a left-padded batch: ``[B, S, V]`` (``[B, 1, V]`` with ``logits_to_keep=1`` in ``constants``).

    Args:
        pg: a PatchableGraph of a causal LM built with ``attention_mask`` and ``position_ids`` in its example inputs.
        batch: ``input_ids``, ``attention_mask``, ``position_ids``, each ``[B, S]``.
        constants: the other keyword arguments of the graph's example call (default ``{"use_cache": False}``).
    """
    output = pg(batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=batch["position_ids"],
                **({"use_cache": False} if constants is None else constants))
    return logits_of(output)


@torch.no_grad()
def greedy_generate(pg: nn.Module, tokenizer: Any, prompts: Sequence[str], max_new_tokens: int = 8,
                    min_batch: int = 1, constants: dict[str, Any] | None = None) -> list[str]:
    """Greedy continuations of ``prompts`` (patches active in the caller's ``pg.patch`` block apply).

    Args:
        pg: as for :func:`graph_logits`.
        tokenizer: the model's tokenizer.
        prompts: ``B`` prompts, generated as one left-padded batch.
        max_new_tokens: tokens generated per prompt.
        min_batch: pad the batch with copies of the first prompt up to this many rows (2 keeps a graph extracted
            on a batch of 2 or more from being extracted again for a batch of 1); the copies are dropped.
        constants: as for :func:`graph_logits`.

    Returns:
        The ``B`` continuations (new tokens only), decoded without special tokens.
    """
    if not prompts:
        return []
    encoded = [encode(tokenizer, prompt) for prompt in prompts]
    rows = encoded + [encoded[0]] * max(0, min_batch - len(encoded))
    batch = {key: value.to(model_device(pg)) for key, value in left_pad(rows, pad_token_id(tokenizer)).items()}
    new_tokens = []
    for _ in range(max_new_tokens):
        logits = graph_logits(pg, batch, constants)
        token = logits[:, -1].argmax(-1, keepdim=True)  # [B, 1]
        new_tokens.append(token)
        ones = torch.ones_like(token)
        batch = {
            "input_ids": torch.cat([batch["input_ids"], token], dim=1),
            "attention_mask": torch.cat([batch["attention_mask"], ones], dim=1),
            "position_ids": torch.cat([batch["position_ids"], batch["position_ids"][:, -1:] + 1], dim=1),
        }
    generated = torch.cat(new_tokens, dim=1)[: len(prompts)]
    return [tokenizer.decode(row.tolist(), skip_special_tokens=True) for row in generated]
