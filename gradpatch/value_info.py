"""Light descriptions of example values (shapes and container structure) kept for the NodePath tree (the module was
``gradpatch.values``, a name that read like the editors' value search)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["ValueInfo", "describe", "holds_input", "is_live_object"]


@dataclass(frozen=True)
class ValueInfo:
    """What a node produced on the example inputs, without holding the tensors.

    Attributes:
        kind: ``"Tensor"``, a container type name (``"tuple"``, ``"dict"``, ``"CausalLMOutputWithPast"``) or the
            type name of another Python value.
        shape: the tensor's ``torch.Size``; ``None`` for non-tensors.
        items: dig part (``sub_0`` or a key) -> description, for containers.
    """

    kind: str
    shape: torch.Size | None = None
    items: dict[str, "ValueInfo"] = field(default_factory=dict)

    @staticmethod
    def unknown() -> "ValueInfo":
        """For a value never computed (a submodule its opaque parent did not call on the example inputs)."""
        return ValueInfo("")

    def label(self) -> str:
        """``Tensor(3, 2)``, ``tuple(2)``, ``int`` — as the tree shows it; empty when unknown."""
        if self.shape is not None:
            return f"Tensor({', '.join(str(size) for size in self.shape)})"
        if self.items:
            return f"{self.kind}({len(self.items)})"
        return "" if self.kind in ("tuple", "list", "dict") else self.kind  # empty containers: no label


def describe(value: Any) -> ValueInfo:
    """Describe ``value`` (a tensor, a container of tensors, or any other object) for the tree."""
    if isinstance(value, torch.Tensor):
        return ValueInfo("Tensor", value.shape)
    if isinstance(value, (tuple, list)):
        return ValueInfo(type(value).__name__, None, {f"sub_{i}": describe(item) for i, item in enumerate(value)})
    if isinstance(value, dict):
        return ValueInfo(type(value).__name__, None, {str(key): describe(item) for key, item in value.items()})
    return ValueInfo(type(value).__name__)


def holds_input(value: Any) -> bool:
    """Whether ``value`` must reach the graph at run time: a tensor, a live object (:func:`is_live_object`), or a
    (nested) tuple, list or dict holding one. Other values are constants baked into the graph."""
    if isinstance(value, (tuple, list)):
        return any(holds_input(item) for item in value)
    if isinstance(value, dict):
        return any(holds_input(item) for item in value.values())
    return isinstance(value, torch.Tensor) or is_live_object(value)


def is_live_object(value: Any) -> bool:
    """Whether ``value`` is an object whose state changes between calls and that the model's code calls methods
    on: a transformers KV cache (``DynamicCache``, ``StaticCache``…). Graphs take it as an input, and its method
    calls (``past_key_values.update(k, v, layer_idx)``) are nodes that run on the cache passed to each call."""
    return any(cls.__name__ == "Cache" and cls.__module__.startswith("transformers")
               for cls in type(value).__mro__)
