"""Position-prefix caching for the exact sweep: the variants patched at position ``p`` run only the tokens from ``p``.

Patching one unit at position ``p`` of a causal language model changes nothing before ``p``, at any layer: attention
reads only earlier positions, so every activation at positions ``< p`` is the base run's. The sweep therefore runs the
base prompts once with the model's own KV cache (a transformers ``DynamicCache``) and runs each pass of variants
patched at ``p`` on tokens ``[p, end)`` only, with that cache cropped to ``p`` tokens and repeated along the batch for
the variants' rows (:meth:`PositionPrefix.call_kwargs`); the patches find their position ``p`` at index 0 of the
suffix (:func:`~gradpatch.attribution.exact.variant_patches` indexes from the end). The exact sweep's other saving
stacks with it: blocks before a pass's first patched block run once on the base rows, so their cache layers keep the
base rows and only the later layers are repeated.

A suffix pass gets an explicit additive causal mask ``[1, 1, suffix, p + suffix]`` (0 where a token may attend, the
dtype's minimum where not), the form transformers' eager and SDPA attention take as a prepared 4-D mask; its batch
dimension of 1 broadcasts over base rows and variant rows alike. The mask and the cache must reproduce the whole
prompt's computation: before the sweep, :func:`position_prefix` runs one suffix pass of the base prompts for each
class of sizes the sweep will use (1 or more cached tokens, 1 or more suffix tokens) and compares its metric with the
base run's. Where that fails (an attention this mask does not describe: sliding windows, ALiBi, a bidirectional
model), where the model's ``forward`` takes no cache or no ``attention_mask``, or where the call's keyword arguments
hold tensors of the whole prompt, :func:`position_prefix` returns ``None`` and every pass runs the whole prompt.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from ..generation import cache_argument
from ..model_io import model_dtype, wrapped_model
from ..patches import CustomPatch
from ..value_info import holds_input
from .runner import Runner

__all__ = ["PositionPrefix", "causal_mask", "position_prefix", "quiet_extraction", "repeat_rows", "same_metric"]


def repeat_rows(copies: int) -> CustomPatch:
    """A patch that repeats its value ``[rows, ...]`` ``copies`` times along the batch: ``[copies * rows, ...]``, row
    block ``v`` a copy of the rows."""

    def op(value: torch.Tensor) -> torch.Tensor:
        return value.repeat(copies, *([1] * (value.dim() - 1)))

    return CustomPatch(custom_op=op, requires_clone=False)


@contextlib.contextmanager
def quiet_extraction() -> Iterator[None]:
    """Silence gradpatch's "extracting graphs" warnings in the block: the sweep's cached calls (a cache, a 4-D mask,
    suffixes of each size class) are new kinds of call the user did not make; each is extracted once per graph."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="gradpatch: extracting graphs")
        yield


def causal_mask(prefix: int, suffix: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The additive causal mask of ``suffix`` query tokens that follow ``prefix`` cached tokens: ``[1, 1, suffix,
    prefix + suffix]``, 0 where query ``i`` (position ``prefix + i``) may attend to key ``j`` (``j <= prefix + i``),
    ``torch.finfo(dtype).min`` elsewhere."""
    query = torch.arange(prefix, prefix + suffix, device=device)[:, None]
    key = torch.arange(prefix + suffix, device=device)[None, :]
    mask = torch.zeros(suffix, prefix + suffix, dtype=dtype, device=device)
    return mask.masked_fill(key > query, torch.finfo(dtype).min)[None, None]


def same_metric(value: float, base_value: float, dtype: torch.dtype) -> bool:
    """Whether a metric computed another way (on a cache, on shared rows) equals the base run's up to float rounding
    in ``dtype``: within ``max(1e-4, 8 eps) * (1 + |base|)``."""
    return abs(value - base_value) <= max(1e-4, 8 * torch.finfo(dtype).eps) * (1 + abs(base_value))


def _cache_class() -> Any:
    try:
        from transformers import DynamicCache
    except ImportError:  # pragma: no cover - depends on the environment
        return None
    return DynamicCache


class PositionPrefix:
    """The base run's keys and values at every position, from which each suffix pass gets its cache.

    Args:
        runner: the sweep's runner (its base prompts, ``[rows, seq]``).
        cache_name: the model's name for its cache argument (``cache`` or ``past_key_values``).
        cache: a ``DynamicCache`` of the base rows over all ``seq`` tokens.
    """

    def __init__(self, runner: Runner, cache_name: str, cache: Any) -> None:
        self.runner = runner
        self.cache_name = cache_name
        self.cache = cache
        self.dtype = model_dtype(runner.pg)

    def call_kwargs(self, prefix: int, copies: int, first_layer: int) -> dict[str, Any]:
        """Keyword arguments of a pass over tokens ``[prefix, seq)``: the cache cropped to ``prefix`` tokens, its layers
        from ``first_layer`` on repeated ``copies`` times along the batch (row block ``v`` a copy of the base rows;
        earlier layers run on the base rows), the causal mask and ``use_cache=True``.

        Raises:
            ValueError: ``prefix`` is not in ``[1, seq)``.
        """
        length = self.runner.batch.length
        if not 0 < prefix < length:
            raise ValueError(f"prefix {prefix}: a suffix pass needs 1 to {length - 1} cached tokens")
        cache = copy.deepcopy(self.cache)
        rows = torch.arange(self.runner.batch.size, device=self.runner.base_ids.device).repeat(copies)
        for index, layer in enumerate(cache.layers):
            extra = int(layer.get_seq_length()) - prefix
            if extra > 0:
                layer.crop(-extra)
            if index >= first_layer and copies > 1:
                layer.batch_select_indices(rows)
        mask = causal_mask(prefix, length - prefix, self.dtype, self.runner.base_ids.device)
        return {self.cache_name: cache, "attention_mask": mask, "use_cache": True}


def _supported(runner: Runner) -> str | None:
    """The model's cache argument name when its ``forward`` takes a cache and an ``attention_mask``, it is not an
    encoder-decoder, transformers' ``DynamicCache`` is there and no keyword argument of the calls holds a tensor;
    else ``None``."""
    model = wrapped_model(runner.pg)
    config = getattr(model, "config", None)
    name = cache_argument(model)
    if (name is None or config is None or getattr(config, "is_encoder_decoder", False) or _cache_class() is None
            or any(holds_input(value) for value in runner.forward_kwargs.values())):
        return None
    try:
        parameters = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return None
    return name if "attention_mask" in parameters else None


def _size_class(prefix: int, length: int) -> tuple[int, int]:
    """What decides which graphs a suffix pass runs (gradpatch extracts graphs per class of sizes, each size 1 or
    larger): the cached tokens and the suffix's tokens, each counted as 1 or more."""
    return min(prefix, 2), min(length - prefix, 2)


def position_prefix(runner: Runner, positions: Sequence[int], base_value: float) -> PositionPrefix | None:
    """The base run's cache, checked: the base prompts in one pass with a fresh ``DynamicCache``, then for each class
    of sizes among the suffix passes to come (1 or more cached tokens, 1 or more suffix tokens) one suffix pass of the
    base rows on that cache, whose metric must equal ``base_value``. Those checks also extract the graphs of each
    class on the base rows alone (a graph is extracted by running the model on the call's own arguments, without
    patches, so a sweep pass whose early cache layers hold base rows and later ones variant rows must not be the first
    of its class). Every pass counts in the runner's forwards.

    Args:
        runner: the sweep's runner.
        positions: the patched positions; those after 0 get suffix passes.
        base_value: the metric of the base run without a cache.

    Returns:
        The cache, or ``None`` where the sweep must run whole prompts: no position after 0, a model that cannot take
        the cache (see the module docstring), or a check that failed (with a warning).
    """
    name = _supported(runner)
    length = runner.batch.length
    checks: dict[tuple[int, int], int] = {}
    for position in sorted(positions):
        if 0 < position < length:
            checks.setdefault(_size_class(position, length), position)
    if name is None or not checks:
        return None
    dtype, device = model_dtype(runner.pg), runner.base_ids.device
    cache = _cache_class()(config=wrapped_model(runner.pg).config)
    values = []
    try:
        with torch.no_grad(), quiet_extraction():
            runner.logits(runner.base_ids, None, {name: cache, "use_cache": True,
                                                  "attention_mask": causal_mask(0, length, dtype, device)})
            prefix = PositionPrefix(runner, name, cache)
            for position in checks.values():
                logits = runner.logits(runner.base_ids[:, position:], None, prefix.call_kwargs(position, 1, 0))
                values.append((position, float(runner.value(logits))))
    except Exception as error:  # noqa: BLE001 - any failure of the cached call means: run whole prompts
        warnings.warn(f"exact_sweep: the position-prefix cache does not work for this model ({type(error).__name__}: "
                      f"{error}); every pass runs the whole prompt", stacklevel=3)
        return None
    wrong = [(position, value) for position, value in values if not same_metric(value, base_value, dtype)]
    if int(cache.get_seq_length()) != length or wrong:
        warnings.warn(f"exact_sweep: suffix passes on the position-prefix cache gave the metric (from position, value) "
                      f"{wrong} where the whole prompt gives {base_value:.6g} (the model's attention is not the causal "
                      f"attention the cache assumes); every pass runs the whole prompt", stacklevel=3)
        return None
    return prefix
