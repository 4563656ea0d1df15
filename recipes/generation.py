"""Greedy generation through a PatchableGraph, with the call convention of the recipes.

The recipes call the graph as ``pg(input_ids, attention_mask=..., position_ids=..., use_cache=False)`` on
left-padded batches (:func:`graph_logits`). Generation runs ``pg.generate`` with the model's KV cache: the prompt
once, then one forward pass per new token, patches active at each. A delta at the last position (``slice`` ``-1``)
acts on the last prompt token and then on each new token once, as it was trained on the last position; what it
changed in earlier tokens stays in the cache (recomputing without a cache would drop it).

ReFT patches (:mod:`gradpatch.interventions.reft`) given to :func:`greedy_generate` as ``patches`` edit each prompt's
first/last tokens during the prefill pass only; the generated tokens are not intervened on (as pyreft generates), and
what the edit changed reaches them through the KV cache. Other patches in ``patches`` (a BiPO/CAA steering ``AddPatch``)
apply at every pass, to every token.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from gradpatch.model_io import call_left_padded, logits_of, model_device
from gradpatch.patches import Patch
from gradpatch.interventions.reft import prefill_patch_map

from .tokens import encode, left_pad, pad_token_id

__all__ = ["generate_with_patches", "graph_logits", "greedy_generate"]


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
                    batch_size: int | None = None, skip_special_tokens: bool = True,
                    patches: Mapping[str, Sequence[Patch]] | None = None) -> list[str]:
    """Greedy continuations of ``prompts`` through ``model.generate`` with the KV cache: a PatchableGraph (patches
    active in the caller's ``pg.patch`` block apply at every step) or a plain ``transformers`` model.

    Args:
        model: a PatchableGraph of a causal LM, or the causal LM itself.
        tokenizer: the model's tokenizer.
        prompts: ``B`` prompts, generated in left-padded batches.
        max_new_tokens: tokens generated per prompt (fewer if a row ends with the end-of-sequence token).
        batch_size: prompts per ``generate`` call (``None``: all at once; 1: one prompt at a time, no padding).
        skip_special_tokens: decode without special tokens (the end-of-sequence token included).
        patches: NodePath -> patches applied during each batch's generation (``model`` must be a PatchableGraph):
            ReFT patches at each prompt's own positions in the prefill pass, the others at every pass (module
            docstring); checked against every prompt before the first batch.

    Returns:
        The ``B`` continuations (new tokens only), decoded.

    Raises:
        ValueError: ``batch_size`` below 1.
        SubspaceConfigError: a prompt shorter than a ReFT patch's positions (before generating).
    """
    if batch_size is not None and batch_size < 1:
        raise ValueError(f"batch_size must be at least 1 (or None for one batch), got {batch_size}")
    pad = pad_token_id(tokenizer)
    device = model_device(model)
    encoded = [encode(tokenizer, prompt) for prompt in prompts]
    if patches is not None:
        prefill_patch_map(patches, [len(ids) for ids in encoded])  # positions past a prompt fail here
    size = batch_size or max(len(prompts), 1)
    out: list[str] = []
    for start in range(0, len(encoded), size):
        rows = encoded[start:start + size]
        batch = left_pad(rows, pad)
        width = batch["input_ids"].shape[1]
        patched: Any = contextlib.nullcontext()
        if patches is not None:
            patched = model.patch(prefill_patch_map(patches, [len(r) for r in rows], [width - len(r) for r in rows]))
        with patched:
            generated = model.generate(batch["input_ids"].to(device), attention_mask=batch["attention_mask"].to(device),
                                       max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad)
        out += [tokenizer.decode(row.tolist(), skip_special_tokens=skip_special_tokens) for row in generated[:, width:]]
    return out


def generate_with_patches(pg: Any, tokenizer: Any, patches: Mapping[str, Sequence[Patch]], prompts: Sequence[str],
                          max_new_tokens: int = 32, batch_size: int = 8) -> list[str]:
    """:func:`greedy_generate` of ``prompts`` on ``pg`` with ``patches`` (e.g. ``Intervention.patch_map()``; ``{}``
    for the model alone), in left-padded batches of ``batch_size``, decoded without special tokens.

    Raises:
        SubspaceConfigError: a prompt shorter than a ReFT patch's positions (before generating).
        ValueError: ``batch_size`` or ``max_new_tokens`` below 1.
    """
    if batch_size < 1 or max_new_tokens < 1:
        raise ValueError(f"batch_size and max_new_tokens must be >= 1, got {batch_size}, {max_new_tokens}")
    return greedy_generate(pg, tokenizer, prompts, max_new_tokens, batch_size=batch_size, patches=patches)
