"""transformers, when installed: the classes gradpatch (and code written for graphpatch) refer to, and the one
adjustment extraction makes to transformers' own code (:func:`eager_mask_decisions`).

``AVAILABLE`` says whether ``transformers`` imported; without it, the names are empty stand-in classes so that
``isinstance`` checks against them are simply false.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from ..tracer import ValueProxy, depends_on_input_values

try:
    from transformers import (
        AutoConfig,
        AutoModel,
        AutoTokenizer,
        BitsAndBytesConfig,
        GenerationConfig,
        GenerationMixin,
        GPT2LMHeadModel,
        LlamaForCausalLM,
        LlamaModel,
        PretrainedConfig,
        PreTrainedModel,
        PreTrainedTokenizer,
    )
    from transformers.modeling_outputs import CausalLMOutput
    from transformers.utils.generic import ModelOutput

    AVAILABLE = True
except ImportError:  # pragma: no cover - depends on the environment
    AVAILABLE = False

    class AutoConfig:  # type: ignore[no-redef]
        """Stand-in: transformers is not installed."""

    class AutoModel:  # type: ignore[no-redef]
        """Stand-in: transformers is not installed."""

    class AutoTokenizer:  # type: ignore[no-redef]
        """Stand-in: transformers is not installed."""

    class BitsAndBytesConfig:  # type: ignore[no-redef]
        """Stand-in: transformers is not installed."""

    class GenerationConfig:  # type: ignore[no-redef]
        """Stand-in: transformers is not installed."""

    class GenerationMixin:  # type: ignore[no-redef]
        """Stand-in: transformers is not installed."""

    class GPT2LMHeadModel:  # type: ignore[no-redef]
        """Stand-in: transformers is not installed."""

    class LlamaForCausalLM:  # type: ignore[no-redef]
        """Stand-in: transformers is not installed."""

    class LlamaModel:  # type: ignore[no-redef]
        """Stand-in: transformers is not installed."""

    class PretrainedConfig:  # type: ignore[no-redef]
        """Stand-in: transformers is not installed."""

    class PreTrainedModel:  # type: ignore[no-redef]
        """Stand-in: transformers is not installed."""

    class PreTrainedTokenizer:  # type: ignore[no-redef]
        """Stand-in: transformers is not installed."""

    class CausalLMOutput:  # type: ignore[no-redef]
        """Stand-in: transformers is not installed."""

    class ModelOutput:  # type: ignore[no-redef]
        """Stand-in: transformers is not installed."""


@contextmanager
def eager_mask_decisions() -> Iterator[None]:
    """While extracting, let transformers build attention masks as it does in eager mode when the positions are
    the ones the model derived from the input sizes.

    Under a tracer, transformers' ``find_packed_sequence_indices`` cannot test whether the position ids hold
    several packed sequences (a decision on tensor values), so it keeps a general mask: the graph would then
    build a full ``[batch, 1, seq, seq]`` mask and call attention with it, where eager mode calls SDPA with
    ``is_causal=True`` (flash attention, no repeated key/value heads). Positions computed inside the model from
    sizes alone (``cache_position.unsqueeze(0)``, an ``arange``) are one contiguous sequence per row for every
    size, which is eager mode's answer too: for those, this returns ``None`` ("not packed") without looking.
    Position ids that came from the caller keep transformers' general mask.
    """
    masking = sys.modules.get("transformers.masking_utils")
    original: Callable[[Any], Any] | None = getattr(masking, "find_packed_sequence_indices", None)
    if original is None:
        yield
        return

    def find_packed_sequence_indices(position_ids: Any) -> Any:
        if isinstance(position_ids, ValueProxy) and not depends_on_input_values(position_ids.node):
            return None
        return original(position_ids)

    masking.find_packed_sequence_indices = find_packed_sequence_indices  # type: ignore[union-attr]
    try:
        yield
    finally:
        masking.find_packed_sequence_indices = original  # type: ignore[union-attr]


__all__ = [
    "AVAILABLE",
    "AutoConfig",
    "AutoModel",
    "AutoTokenizer",
    "BitsAndBytesConfig",
    "CausalLMOutput",
    "GPT2LMHeadModel",
    "GenerationConfig",
    "GenerationMixin",
    "LlamaForCausalLM",
    "LlamaModel",
    "ModelOutput",
    "PreTrainedModel",
    "PreTrainedTokenizer",
    "PretrainedConfig",
    "eager_mask_decisions",
]
