"""The part of the value search that does not depend on ``δ``, computed once: a KV cache of each row's prefix.

ROME's value objective (Meng et al. 2022, §3.1, eq. 4) adds ``δ`` to a layer's output at the subject's last token
``s`` of every prompt. In a causal model nothing at a position before ``s`` depends on ``δ``, at any layer: those
positions' keys and values are the same at every step of the search. :class:`PrefixCache` computes them once per
row (no gradients; one pass over the rows' prefixes, left-padded) and each step then runs only the row's tokens
from ``s`` on, attending to the cached prefix through the model's own cache (a transformers ``DynamicCache``,
passed as ``cache`` or, before transformers 5.24, ``past_key_values``) with explicit position ids and attention
mask. On the fact bank's prompts (SmolLM2-135M, six context prefixes) the tokens from ``s`` on are 36 % of all
tokens, so a step's forward and backward passes carry a third of the tokens they did. The logits are the full
passes' up to float rounding (``tests/test_prefix_cache.py``).

Memory: the cache holds ``2 · layers · kv_heads · head_dim`` numbers per prefix token (SmolLM2-135M: 46 kB per token in
float32; the 1,000 facts of a MEMIT batch, with seven prompts each, ~3.7 GB) for the length of one search.

Only models whose ``forward`` takes a cache (``cache`` or ``past_key_values``), ``position_ids`` and
``attention_mask`` and whose config says ``use_cache``-style decoding is possible (transformers decoder-only
language models) can use it; :func:`supports_prefix_cache` tells, and the batched search runs full passes otherwise.
"""

from __future__ import annotations

import contextlib
import inspect
import warnings
from collections.abc import Hashable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from gradpatch.generation import cache_argument

from .layers import model_device, wrapped_model

__all__ = ["PrefixCache", "quiet_extraction", "supports_prefix_cache"]

_ARGUMENTS = ("position_ids", "attention_mask")  # besides the cache (gradpatch.generation.cache_argument)


@contextlib.contextmanager
def quiet_extraction() -> Iterator[None]:
    """Silence gradpatch's "extracting graphs" warnings for the block: the value search's cached calls (prefixes,
    suffixes of each length class) are new kinds of call the user did not make, extracted once each."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="gradpatch: extracting graphs")
        yield


def supports_prefix_cache(pg: nn.Module) -> bool:
    """Whether ``pg``'s model takes a transformers ``DynamicCache`` with position ids and an attention mask (decoder-only
    transformers language models do; encoder-decoder models and plain modules do not)."""
    return _prefix_cache_argument(pg) is not None


def _prefix_cache_argument(pg: nn.Module) -> str | None:
    """The name of the cache argument of ``pg``'s model (:func:`gradpatch.generation.cache_argument`) when the model
    can run on a prefix cache (see :func:`supports_prefix_cache`), else ``None``."""
    model = wrapped_model(pg)
    config = getattr(model, "config", None)
    if config is None or getattr(config, "is_encoder_decoder", False):
        return None
    name = cache_argument(model)  # None also when the signature cannot be read
    if name is None:
        return None
    parameters = inspect.signature(model.forward).parameters
    return name if all(argument in parameters for argument in _ARGUMENTS) else None


class PrefixCache:
    """Keys and values of each row's prefix (the tokens before its split position), for the layers of ``pg``.

    Args:
        pg: the model's PatchableGraph (patches active when a prefix is computed apply to it).
        pad: the token id written into padding.
        max_tokens: tokens (rows × padded width) per pass when prefixes are computed.

    Raises:
        ValueError: the model cannot take a cache (see :func:`supports_prefix_cache`) or ``max_tokens`` < 1.
    """

    def __init__(self, pg: nn.Module, pad: int, max_tokens: int) -> None:
        cache_name = _prefix_cache_argument(pg)
        if cache_name is None:
            raise ValueError(f"{type(wrapped_model(pg)).__name__} does not take a cache, position_ids and "
                             f"attention_mask; run the value search with prefix_cache=False")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be positive, got {max_tokens}")
        self.pg, self.pad, self.max_tokens = pg, pad, max_tokens
        self.config = wrapped_model(pg).config
        self.cache_name: str = cache_name  # the model's name for its cache argument
        self.device = model_device(pg)
        # row key -> (keys, values), each [layers, kv_heads, prefix_length, head_dim]; None for an empty prefix
        self._states: dict[Hashable, tuple[torch.Tensor, torch.Tensor] | None] = {}

    def __len__(self) -> int:
        return len(self._states)

    def fill(self, keys: Sequence[Hashable], prefixes: Sequence[Sequence[int]]) -> None:
        """Compute and keep the prefix states of the rows not yet cached (one no-grad pass per group of rows of
        similar length that fits ``max_tokens``). An empty prefix is kept as ``None`` (nothing to attend to)."""
        todo = [(key, list(prefix)) for key, prefix in zip(keys, prefixes) if key not in self._states]
        for key, prefix in todo:
            if not prefix:
                self._states[key] = None
        todo = sorted(((key, prefix) for key, prefix in todo if prefix), key=lambda item: len(item[1]))
        group: list[tuple[Hashable, list[int]]] = []
        for item in todo:
            if group and (len(group) + 1) * len(item[1]) > self.max_tokens:
                self._compute(group)
                group = []
            group.append(item)
        if group:
            self._compute(group)

    @torch.no_grad()
    def _compute(self, group: list[tuple[Hashable, list[int]]]) -> None:
        width = max(len(prefix) for _, prefix in group)
        ids = torch.full((len(group), width), self.pad, dtype=torch.long)
        mask = torch.zeros((len(group), width), dtype=torch.long)
        for i, (_, prefix) in enumerate(group):  # left-padded: every prefix ends at the same column
            ids[i, width - len(prefix):] = torch.tensor(prefix)
            mask[i, width - len(prefix):] = 1
        positions = (mask.cumsum(-1) - 1).clamp_min(0)
        cache = _new_cache(self.config)
        with quiet_extraction():
            output = self.pg(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                             position_ids=positions.to(self.device), use_cache=True, **{self.cache_name: cache})
        returned = getattr(output, self.cache_name, None)
        cache = cache if returned is None else returned
        keys = torch.stack([layer.keys for layer in cache.layers], dim=1)  # [rows, layers, kv_heads, width, head]
        values = torch.stack([layer.values for layer in cache.layers], dim=1)
        for i, (key, prefix) in enumerate(group):
            start = width - len(prefix)
            self._states[key] = (keys[i, :, :, start:].clone(), values[i, :, :, start:].clone())

    def discard(self, keys: Sequence[Hashable]) -> None:
        """Forget the rows' prefix states (rows that will not run again: their memory is freed)."""
        for key in keys:
            self._states.pop(key, None)

    def inputs(self, keys: Sequence[Hashable], suffixes: Sequence[Sequence[int]]) -> dict[str, Any]:
        """Model keyword arguments for the rows' suffixes after their cached prefixes.

        Args:
            keys: the rows' keys (each cached by :meth:`fill`).
            suffixes: ``R`` non-empty token lists, each the row's tokens from its split position on.

        Returns:
            ``input_ids`` ``[R, S]`` (right-padded), ``attention_mask`` ``[R, P + S]`` (prefixes left-padded to
            ``P``, the longest), ``position_ids`` ``[R, S]`` (each row continues its own prefix),
            the cache argument (:attr:`cache_name`: a fresh ``DynamicCache`` holding the prefixes) and
            ``use_cache=True``; when no row has a prefix, a plain right-padded pass: ``input_ids`` and
            ``use_cache=False``.

        Raises:
            KeyError: a row's prefix was not cached.
            ValueError: a suffix is empty.
        """
        if any(len(s) == 0 for s in suffixes):
            raise ValueError("every row needs at least one token from its split position on")
        states = [self._states[key] for key in keys]
        lengths = [0 if state is None else state[0].shape[2] for state in states]
        prefix_width, width = max(lengths), max(len(s) for s in suffixes)
        rows, device = len(keys), self.device
        ids = torch.full((rows, width), self.pad, dtype=torch.long)
        for i, suffix in enumerate(suffixes):
            ids[i, : len(suffix)] = torch.tensor(list(suffix))
        if prefix_width == 0:
            return {"input_ids": ids.to(device), "use_cache": False}
        mask = torch.zeros((rows, prefix_width + width), dtype=torch.long)
        positions = torch.zeros((rows, width), dtype=torch.long)
        for i, (length, suffix) in enumerate(zip(lengths, suffixes)):
            mask[i, prefix_width - length : prefix_width + len(suffix)] = 1
            positions[i] = torch.arange(length, length + width)
        reference = next(state for state in states if state is not None)
        cached = []
        for part in (0, 1):
            layers, heads, _, head_dim = reference[part].shape
            padded = reference[part].new_zeros((rows, layers, heads, prefix_width, head_dim))
            for i, (state, length) in enumerate(zip(states, lengths)):
                if state is not None:
                    padded[i, :, :, prefix_width - length :] = state[part]
            cached.append(padded)  # [rows, layers, kv_heads, P, head]
        cache = _new_cache(self.config, [(cached[0][:, layer], cached[1][:, layer])
                                         for layer in range(cached[0].shape[1])])
        return {"input_ids": ids.to(device), "attention_mask": mask.to(device), "position_ids": positions.to(device),
                self.cache_name: cache, "use_cache": True}


def _new_cache(config: Any, data: list[tuple[torch.Tensor, torch.Tensor]] | None = None) -> Any:
    """A transformers ``DynamicCache`` for ``config``'s layers, holding ``data`` (per layer ``(keys, values)``)."""
    from transformers import DynamicCache

    return DynamicCache(ddp_cache_data=data, config=config) if data is not None else DynamicCache(config=config)
