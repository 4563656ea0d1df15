"""Greedy generation through a PatchableGraph, with the call convention of the delta recipes.

The recipes call the graph as ``pg(input_ids, attention_mask=..., position_ids=..., use_cache=False)`` on
left-padded batches (:func:`graph_logits`). Generation runs ``pg.generate`` with the model's KV cache: the prompt
once, then one forward pass per new token, patches active at each. A delta at the last position (``slice`` ``-1``)
acts on the last prompt token and then on each new token once, as it was trained on the last position; what it
changed in earlier tokens stays in the cache (recomputing without a cache would drop it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from gradpatch.model_io import call_left_padded, logits_of, model_device

from .data import encode, left_pad, pad_token_id

__all__ = ["graph_logits", "greedy_generate"]


def graph_logits(pg: nn.Module, batch: dict[str, torch.Tensor], constants: dict[str, Any] | None = None) -> torch.Tensor:
    """Logits of a left-padded batch: ``[B, S, V]`` (``[B, 1, V]`` with ``logits_to_keep=1`` in ``constants``).

    Args:
        pg: a PatchableGraph of a causal LM built with ``attention_mask`` and ``position_ids`` in its example inputs.
        batch: ``input_ids``, ``attention_mask``, ``position_ids``, each ``[B, S]`` (moved to the model's device).
        constants: the other keyword arguments of the graph's example call (default ``{"use_cache": False}``).
    """
    return logits_of(call_left_padded(pg, batch, **({"use_cache": False} if constants is None else constants)))


@torch.no_grad()
def greedy_generate(model: nn.Module, tokenizer: Any, prompts: Sequence[str], max_new_tokens: int = 8, *,
                    batch_size: int | None = None, skip_special_tokens: bool = True) -> list[str]:
    """Greedy continuations of ``prompts`` through ``model.generate`` with the KV cache: a PatchableGraph (patches
    active in the caller's ``pg.patch`` block apply at every step) or a plain ``transformers`` model.

    Args:
        model: a PatchableGraph of a causal LM, or the causal LM itself.
        tokenizer: the model's tokenizer.
        prompts: ``B`` prompts, generated in left-padded batches.
        max_new_tokens: tokens generated per prompt (fewer if a row ends with the end-of-sequence token).
        batch_size: prompts per ``generate`` call (``None``: all at once; 1: one prompt at a time, no padding).
        skip_special_tokens: decode without special tokens (the end-of-sequence token included).

    Returns:
        The ``B`` continuations (new tokens only), decoded.

    Raises:
        ValueError: ``batch_size`` below 1.
    """
    if batch_size is not None and batch_size < 1:
        raise ValueError(f"batch_size must be at least 1 (or None for one batch), got {batch_size}")
    pad = pad_token_id(tokenizer)
    device = model_device(model)
    size = batch_size or max(len(prompts), 1)
    out: list[str] = []
    for start in range(0, len(prompts), size):
        batch = left_pad([encode(tokenizer, prompt) for prompt in prompts[start : start + size]], pad)
        ids = batch["input_ids"].to(device)
        generated = model.generate(ids, attention_mask=batch["attention_mask"].to(device),
                                   max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad)
        out += [tokenizer.decode(row.tolist(), skip_special_tokens=skip_special_tokens)
                for row in generated[:, ids.shape[1]:]]
    return out
