"""The part of the value search that does not depend on ``δ``, computed once: a KV cache of each row's prefix.

ROME's value objective (Meng et al. 2022, §3.1, eq. 4) adds ``δ`` to a layer's output at the subject's last token
``s`` of every prompt. In a causal model nothing at a position before ``s`` depends on ``δ``, at any layer: those
positions' keys and values are the same at every step of the search. :class:`PrefixCache` computes them once per
row (no gradients; one pass over the rows' prefixes, left-padded) and each step then runs only the row's tokens
from ``s`` on, attending to the cached prefix through the model's own cache (a transformers ``DynamicCache``,
passed as ``cache`` or, before transformers 5.24, ``past_key_values``) with explicit position ids and attention
mask. On the fact bank's prompts (SmolLM2-135M, six context prefixes) the tokens from ``s`` on are 36 % of all
tokens, so a step's forward and backward passes carry a third of the tokens they did. The logits are the full
passes' up to float rounding (``tests/editors/test_prefix_cache.py``). Rows behind the same context prefix begin with the
same tokens: :meth:`PrefixCache.fill` computes those once and runs each row's other prefix tokens on them.

Memory: the cache holds ``2 · layers · kv_heads · head_dim`` numbers per prefix token (SmolLM2-135M: 46 kB per token in
float32, 23 kB in bfloat16) for the length of one search. Tokens that rows share are held once: a row keeps the
shared prefix's states by reference and only its own tokens' states (:meth:`PrefixCache.nbytes`).

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

from gradpatch import CustomPatch
from gradpatch.generation import cache_argument
from gradpatch.model_io import model_device, wrapped_model

from .selected_logits import output_embedding_input_node
from .tokens import common_prefix_length, sorted_chunks

__all__ = ["FIRST_PASS_ROWS", "MIN_SHARED_TOKENS", "PrefixCache", "quiet_extraction", "supports_prefix_cache"]

#: Keys and values of consecutive prefix tokens, each ``[layers, kv_heads, tokens, head_dim]``.
StatePart = tuple[torch.Tensor, torch.Tensor]

#: Fewest tokens that rows must begin with for those tokens to run once for all of them.
MIN_SHARED_TOKENS = 4
#: Rows of the first pass over a cache: the first cached call of a PatchableGraph extracts its graphs by running the
#: whole model on it once more (see :func:`editors.passes.tokens.sorted_chunks`): on 372 rows of SmolLM2-135M, 4 GB more.
FIRST_PASS_ROWS = 2
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
        self.head_node = output_embedding_input_node(pg)  # the fill needs no logits: it projects one position
        # row key -> its prefix's parts in order: (its own tokens,), or (a shared prefix, the tokens after it), or
        # (a shared prefix,); () for an empty prefix. A shared prefix's part is one tensor pair for all its rows.
        self._states: dict[Hashable, tuple[StatePart, ...]] = {}
        self._shared: dict[tuple[int, ...], StatePart] = {}  # tokens -> their states

    def __len__(self) -> int:
        return len(self._states)

    def fill(self, keys: Sequence[Hashable], prefixes: Sequence[Sequence[int]]) -> None:
        """Compute and keep the prefix states of the rows not yet cached (one no-grad pass per group of rows of
        similar length that fits ``max_tokens``). An empty prefix keeps nothing (nothing to attend to). Rows that
        begin with the same :data:`MIN_SHARED_TOKENS` or more tokens (the same context prefix) run those tokens once:
        their states are computed in a pass of their own, kept once for all those rows, and the rows' other tokens
        run on them."""
        todo = [(key, list(prefix)) for key, prefix in zip(keys, prefixes) if key not in self._states]
        for key, prefix in todo:
            if not prefix:
                self._states[key] = ()
        by_start: dict[tuple[int, ...], list[tuple[Hashable, list[int]]]] = {}
        for key, prefix in todo:
            if prefix:
                by_start.setdefault(tuple(prefix[:MIN_SHARED_TOKENS]), []).append((key, prefix))
        alone: list[tuple[Hashable, list[int]]] = []
        for group in by_start.values():
            shared = common_prefix_length([prefix for _, prefix in group]) if len(group) > 1 else 0
            if shared >= MIN_SHARED_TOKENS:
                self._fill_after_shared(group, shared)
            else:
                alone += group
        for chunk in _chunks(sorted(alone, key=lambda item: len(item[1])), self.max_tokens, 0):
            for (key, _), state in zip(chunk, self._run(chunk)):
                self._states[key] = (state,)

    def _fill_after_shared(self, group: list[tuple[Hashable, list[int]]], shared: int) -> None:
        """Fill rows whose prefixes all begin with the same ``shared`` tokens: those once, then the rest on them
        (each row keeps the shared tokens' states by reference and its own tokens' states)."""
        head = tuple(group[0][1][:shared])
        if head not in self._shared:
            self._shared[head] = self._run([(head, list(head))])[0]
        common = self._shared[head]
        rest = []
        for key, prefix in group:
            if len(prefix) == shared:
                self._states[key] = (common,)
            else:
                rest.append((key, prefix[shared:]))
        for chunk in _chunks(sorted(rest, key=lambda item: len(item[1])), self.max_tokens, shared):
            inputs = self._inputs([(common,)] * len(chunk), [tail for _, tail in chunk])
            for (key, tail), (keys, values) in zip(chunk, self._forward(inputs)):
                end = shared + len(tail)
                self._states[key] = (common, (keys[:, :, shared:end].clone(), values[:, :, shared:end].clone()))

    @torch.no_grad()
    def _run(self, group: list[tuple[Hashable, list[int]]]) -> list[StatePart]:
        """The states of ``group``'s prefixes, computed from scratch in one left-padded pass."""
        width = max(len(prefix) for _, prefix in group)
        ids = torch.full((len(group), width), self.pad, dtype=torch.long)
        mask = torch.zeros((len(group), width), dtype=torch.long)
        for i, (_, prefix) in enumerate(group):  # left-padded: every prefix ends at the same column
            ids[i, width - len(prefix):] = torch.tensor(prefix)
            mask[i, width - len(prefix):] = 1
        positions = (mask.cumsum(-1) - 1).clamp_min(0)
        states = self._forward({"input_ids": ids.to(self.device), "attention_mask": mask.to(self.device),
                                "position_ids": positions.to(self.device), "use_cache": True,
                                self.cache_name: _new_cache(self.config)})
        return [(keys[:, :, width - len(prefix):].clone(), values[:, :, width - len(prefix):].clone())
                for (_, prefix), (keys, values) in zip(group, states)]

    @torch.no_grad()
    def _forward(self, inputs: dict[str, Any]) -> list[StatePart]:
        """Run a cached pass and return each row's states in the cache after it, ``[layers, kv_heads, width,
        head_dim]`` (views)."""
        cache = inputs[self.cache_name]
        patches = {} if self.head_node is None else {self.head_node: CustomPatch(custom_op=_one_position)}
        with quiet_extraction(), self.pg.patch(patches):
            output = self.pg(**inputs)
        returned = getattr(output, self.cache_name, None)
        cache = cache if returned is None else returned
        keys = torch.stack([layer.keys for layer in cache.layers], dim=1)  # [rows, layers, kv_heads, width, head]
        values = torch.stack([layer.values for layer in cache.layers], dim=1)
        return [(keys[i], values[i]) for i in range(keys.shape[0])]

    def discard(self, keys: Sequence[Hashable]) -> None:
        """Forget the rows' prefix states (rows that will not run again: their memory is freed)."""
        for key in keys:
            self._states.pop(key, None)

    def nbytes(self) -> int:
        """Bytes of the prefix states the cache holds, each tensor counted once (a shared prefix's states once for
        all rows behind it)."""
        storages: dict[int, int] = {}  # storage address -> bytes
        for parts in (*self._states.values(), tuple(self._shared.values())):
            for part in parts:
                for tensor in part:
                    storage = tensor.untyped_storage()
                    storages[storage.data_ptr()] = storage.nbytes()
        return sum(storages.values())

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
        return self._inputs([self._states[key] for key in keys], suffixes)

    def _inputs(self, states: Sequence[tuple[StatePart, ...]], suffixes: Sequence[Sequence[int]]) -> dict[str, Any]:
        """:meth:`inputs` for rows given by their prefix states (each row's parts in order)."""
        if any(len(s) == 0 for s in suffixes):
            raise ValueError("every row needs at least one token from its split position on")
        lengths = [sum(part[0].shape[2] for part in state) for state in states]
        prefix_width, width = max(lengths), max(len(s) for s in suffixes)
        rows, device = len(states), self.device
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
        reference = next(state for state in states if state)[0]
        cached = []
        for k in (0, 1):  # keys, then values
            layers, heads, _, head_dim = reference[k].shape
            padded = reference[k].new_zeros((rows, layers, heads, prefix_width, head_dim))
            for i, (state, length) in enumerate(zip(states, lengths)):
                start = prefix_width - length  # left-padded: every prefix ends at column prefix_width
                for part in state:
                    padded[i, :, :, start : start + part[k].shape[2]] = part[k]
                    start += part[k].shape[2]
            cached.append(padded)  # [rows, layers, kv_heads, P, head]
        cache = _new_cache(self.config, [(cached[0][:, layer], cached[1][:, layer])
                                         for layer in range(cached[0].shape[1])])
        return {"input_ids": ids.to(device), "attention_mask": mask.to(device), "position_ids": positions.to(device),
                self.cache_name: cache, "use_cache": True}


def _chunks(items: list[tuple[Hashable, list[int]]], max_tokens: int, offset: int
            ) -> list[list[tuple[Hashable, list[int]]]]:
    """:func:`editors.passes.tokens.sorted_chunks` of ``items`` (sorted by length) whose rows are ``offset`` tokens longer."""
    widths = [offset + len(t) for _, t in items]
    return [[items[i] for i in group] for group in sorted_chunks(widths, max_tokens, FIRST_PASS_ROWS)]


def _one_position(hidden: torch.Tensor) -> torch.Tensor:
    """The first row's last position of the output embedding's input ``[batch, seq, d]``, as a contiguous
    ``[1, 1, d]``. Contiguous matters: a linear layer whose weight does not require gradients multiplies a
    non-contiguous 3-D input by a ``bmm`` against its weight expanded to the batch, materialised (PyTorch's
    ``matmul`` folds the batch into one ``mm`` only for a contiguous input or a weight that requires gradients); with
    the value search's frozen weights a ``[rows, 1, d]`` slice made the fill 5× slower."""
    return hidden[:1, -1:].contiguous()


def _new_cache(config: Any, data: list[StatePart] | None = None) -> Any:
    """A transformers ``DynamicCache`` for ``config``'s layers, holding ``data`` (per layer ``(keys, values)``)."""
    from transformers import DynamicCache

    return DynamicCache(ddp_cache_data=data, config=config) if data is not None else DynamicCache(config=config)
