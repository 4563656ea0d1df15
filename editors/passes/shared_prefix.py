"""Activations of many rows that begin with the same tokens, those tokens run once.

The key passes of ROME and MEMIT (Meng et al. 2022, §3.1, eq. 3; Meng et al. 2023, §4.3, eq. 15) read each fact's
subject behind the same few context prefixes: behind one prefix, every fact's row begins with that prefix's tokens.
In a causal model the keys and values of those tokens are the same in every row, so :func:`row_activations` computes
them once (:class:`editors.passes.prefix_cache.PrefixCache`, one row) and runs each row's own tokens on that cache. On the
fact bank's first 1,000 facts behind MEMIT's six key prefixes the shared tokens are 43 % of all tokens (the empty
prefix shares none), and a pass over them reading three nodes up to block 6 of SmolLM2-135M took 16.1 s instead of
22.7 s on two CPU cores (the first such pass in a process, which also extracts the graphs of the cached calls on its
first two rows: 19.8 s). A pass's rows × whole width fit ``max_tokens``, the shared tokens counted: its cache holds
them. The activations are the full passes' up to float rounding (``tests/editors/test_shared_prefix.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from gradpatch.capture import node_activations
from gradpatch.model_io import model_device, right_pad

from .prefix_cache import FIRST_PASS_ROWS, MIN_SHARED_TOKENS, PrefixCache, quiet_extraction, supports_prefix_cache
from .tokens import common_prefix_length, sorted_chunks

__all__ = ["row_activations"]

_SHARED = "shared prefix"  # the one row key of the shared prefix's cache


def row_activations(pg: nn.Module, nodes: Sequence[str], rows: Sequence[Sequence[int]], reads: Sequence[int],
                    pad: int, patches: Mapping[str, Any] | None = None, max_tokens: int = 8192,
                    share_prefix: bool = True) -> list[torch.Tensor]:
    """The activations of ``nodes`` at position ``reads[i]`` of row ``i``, the rows run in right-padded passes of at
    most ``max_tokens`` tokens (rows × width), sorted by length, each pass stopping once every node was recorded.

    With ``share_prefix``, when at least two rows begin with the same :data:`MIN_SHARED_TOKENS` or more tokens before
    the earliest read position and the model takes a cache (:func:`editors.passes.prefix_cache.supports_prefix_cache`),
    those tokens run once and every pass runs only the rows' remaining tokens on their keys and values; the first of
    those passes has :data:`~editors.passes.prefix_cache.FIRST_PASS_ROWS` rows (it may extract the graphs of cached calls).

    Args:
        pg: the model's PatchableGraph.
        nodes: NodePaths of ``[batch, seq, d]`` nodes.
        rows: ``R`` token lists; reads: a position in each.
        pad: the token id written into padding.
        patches: more patches for every pass, the shared prefix's too (patches of weights or of every position: a
            patch of chosen positions would see them shifted in the passes after the shared prefix).
        max_tokens: tokens per pass.
        share_prefix: compute a shared prefix once (off: every row runs whole).

    Returns:
        One ``[R, d]`` tensor per node (the node's dtype), rows in the given order.
    """
    shared = 0
    if share_prefix and len(rows) > 1 and supports_prefix_cache(pg):
        shared = common_prefix_length(rows, min(reads))
    cache = None
    if shared >= MIN_SHARED_TOKENS:
        cache = PrefixCache(pg, pad, max_tokens)
        with quiet_extraction(), pg.patch(dict(patches or {})):
            cache.fill([_SHARED], [list(rows[0][:shared])])
    else:
        shared = 0
    device = model_device(pg)
    order = sorted(range(len(rows)), key=lambda i: len(rows[i]))  # rows of similar length: little padding
    parts: list[list[torch.Tensor]] = [[] for _ in nodes]
    widths = [len(rows[i]) for i in order]  # whole rows: each pass's cache holds the shared tokens too
    for group in sorted_chunks(widths, max_tokens, FIRST_PASS_ROWS if cache is not None else None):
        chunk = [order[i] for i in group]
        if cache is None:
            inputs: dict[str, Any] = {"input_ids": right_pad([rows[i] for i in chunk], pad)[0].to(device)}
        else:
            inputs = cache.inputs([_SHARED] * len(chunk), [rows[i][shared:] for i in chunk])
        with quiet_extraction() if cache is not None else contextlib.nullcontext():  # cached calls: new kinds of call
            activations = node_activations(pg, nodes, inputs.pop("input_ids"), patches=patches, **inputs)
        index = torch.arange(len(chunk))
        positions = torch.tensor([reads[i] - shared for i in chunk])
        for part, activation in zip(parts, activations):
            part.append(activation[index.to(activation.device), positions.to(activation.device)])
    unsort = torch.argsort(torch.tensor(order))
    return [torch.cat(part)[unsort.to(part[0].device)] for part in parts]
