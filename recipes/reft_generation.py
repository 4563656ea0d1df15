"""Greedy KV-cache generation with ReFT patches at the prompt's positions and steering vectors everywhere.

ReFT patches (:mod:`gradpatch.reft`) edit the prompt's first/last tokens during the prefill pass only; the
generated tokens are not intervened on (as pyreft generates), and what the edit changed reaches them through the
KV cache. Other patches (a BiPO/CAA steering ``AddPatch``) apply at every pass, to every token.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from gradpatch.patches import Patch
from gradpatch.reft import prefill_patch_map

from .data import encode, left_pad, pad_token_id

__all__ = ["generate_with_patches"]


@torch.no_grad()
def generate_with_patches(pg: Any, tokenizer: Any, patches: Mapping[str, Sequence[Patch]], prompts: Sequence[str],
                          max_new_tokens: int = 32, batch_size: int = 8) -> list[str]:
    """Greedy continuations of ``prompts`` through ``pg.generate`` (the model's KV cache) with ``patches`` active.

    Args:
        pg: a :class:`gradpatch.PatchableGraph` of a transformers causal LM.
        tokenizer: its tokenizer (prompts are encoded with special tokens, as the ReFT recipes train).
        patches: NodePath -> patches (e.g. ``Intervention.patch_map()``).
        prompts: ``B`` prompts, generated in left-padded batches of ``batch_size``.
        max_new_tokens: tokens per continuation (fewer when it ends with the end-of-sequence token).
        batch_size: prompts per ``generate`` call (≥ 1).

    Returns:
        The ``B`` continuations (new tokens only), decoded without special tokens.

    Raises:
        SubspaceConfigError: a prompt shorter than a ReFT patch's positions (before generating).
        ValueError: ``batch_size`` or ``max_new_tokens`` below 1.
    """
    if batch_size < 1 or max_new_tokens < 1:
        raise ValueError(f"batch_size and max_new_tokens must be >= 1, got {batch_size}, {max_new_tokens}")
    pad = pad_token_id(tokenizer)
    device = next((p.device for p in pg.parameters()), torch.device("cpu"))
    encoded = [encode(tokenizer, prompt) for prompt in prompts]
    lengths = [len(ids) for ids in encoded]
    prefill_patch_map(patches, lengths)  # positions past a prompt fail here, before any generation
    out: list[str] = []
    for start in range(0, len(encoded), batch_size):
        rows = encoded[start:start + batch_size]
        batch = left_pad(rows, pad)
        width = batch["input_ids"].shape[1]
        mapping = prefill_patch_map(patches, [len(r) for r in rows], [width - len(r) for r in rows])
        with pg.patch(mapping):
            generated = pg.generate(batch["input_ids"].to(device), attention_mask=batch["attention_mask"].to(device),
                                    max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad)
        out += [tokenizer.decode(row.tolist(), skip_special_tokens=True) for row in generated[:, width:]]
    return out
