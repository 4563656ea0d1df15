"""transformers, when installed: the classes gradpatch (and code written for graphpatch) refer to (the one adjustment
extraction makes to transformers' own code is :func:`gradpatch.extraction.masks.eager_mask_decisions`).

``AVAILABLE`` says whether ``transformers`` imported; without it, the names are empty stand-in classes so that
``isinstance`` checks against them are simply false.
"""

from __future__ import annotations

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
]
