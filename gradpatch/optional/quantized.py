"""Quantized weights told apart without importing their library (importing bitsandbytes prints and warns on machines
without a GPU, and a model holding its parameters has imported it already)."""

from __future__ import annotations

import torch

#: Top-level packages whose parameter classes hold quantized storage (8-bit ``Int8Params``, 4-bit ``Params4bit``).
QUANTIZING_PACKAGES = ("bitsandbytes",)


def is_quantized_parameter(weight: torch.Tensor) -> bool:
    """Whether ``weight`` is a quantized-storage parameter of bitsandbytes (its class is defined in the package), so
    it cannot be written in place as a float matrix."""
    return type(weight).__module__.split(".")[0] in QUANTIZING_PACKAGES
