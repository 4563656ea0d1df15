"""Patches: functions that change or record the value seen downstream of a graph node.

The classes and their semantics follow graphpatch (``ZeroPatch``, ``AddPatch``, ``ReplacePatch``, ``ProbePatch``,
``RecordPatch``, ``CustomPatch``). Every patch is a keyword-only dataclass with ``op(original) -> new``. With
``slice`` set, ``op`` sees ``original[slice]`` and its result is written into a copy of ``original`` at ``slice``;
the copy keeps autograd intact, so gradients flow to patch values (tensors that require grad or
``nn.Parameter``s) and to the unpatched part of the activation alike.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .errors import PatchShapeError

#: What a ``slice`` may hold: anything valid inside ``tensor[...]`` (ints, slices, ``Ellipsis``, ``None``,
#: index tensors or tuples of those).
Slice = Any


@dataclass(kw_only=True)
class Patch:
    """Base class: identity. Subclasses override :meth:`op`.

    Attributes:
        slice: optional index expression; ``op`` then applies to ``original[slice]`` only.
    """

    slice: Slice = None

    def op(self, original: Any) -> Any:
        """Return the value seen downstream instead of ``original``."""
        return original

    def __call__(self, original: Any) -> Any:
        if self.slice is None:
            return self.op(original)
        if not isinstance(original, torch.Tensor):
            raise TypeError(
                f"{type(self).__name__} has slice={self.slice!r} but the patched value is a "
                f"{type(original).__name__}, not a tensor; dig to a tensor with '|sub_i' in the NodePath"
            )
        try:
            selected = original[self.slice]
        except IndexError as error:
            raise PatchShapeError(
                f"{type(self).__name__} slice {self.slice!r} does not index an activation of shape "
                f"{tuple(original.shape)}: {error}"
            ) from error
        patched = original.clone()
        patched[self.slice] = self.op(selected)
        return patched


def _check_broadcast(patch: Patch, original: torch.Tensor, value: torch.Tensor) -> None:
    """Raise :class:`PatchShapeError` unless ``value`` broadcasts to exactly the shape of ``original``."""
    try:
        ok = torch.broadcast_shapes(value.shape, original.shape) == original.shape
    except RuntimeError:
        ok = False
    if not ok:
        where = "" if patch.slice is None else f" (after slice {patch.slice!r})"
        raise PatchShapeError(
            f"{type(patch).__name__} value of shape {tuple(value.shape)} does not broadcast to the activation of "
            f"shape {tuple(original.shape)}{where}; give a value of shape {tuple(original.shape)} or a slice"
        )


@dataclass(kw_only=True)
class ZeroPatch(Patch):
    """Replace the activation (or ``activation[slice]``) by zeros."""

    def op(self, original: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(original)


@dataclass(kw_only=True)
class AddPatch(Patch):
    """Add ``value`` to the activation: ``original + value`` (broadcasting; value may require grad).

    Attributes:
        value: tensor broadcastable to the activation (or to ``activation[slice]``), e.g. ``[d_model]`` for a
            steering vector added at every position of a ``[batch, seq, d_model]`` residual stream.
    """

    value: torch.Tensor = field(default=None)  # type: ignore[assignment]

    def op(self, original: torch.Tensor) -> torch.Tensor:
        _check_broadcast(self, original, self.value)
        return original + self.value.to(dtype=original.dtype, device=original.device)


@dataclass(kw_only=True)
class ReplacePatch(Patch):
    """Replace the activation by ``value`` (broadcast to the activation's shape).

    Attributes:
        value: tensor broadcastable to the activation (or ``activation[slice]``); may require grad.
    """

    value: torch.Tensor = field(default=None)  # type: ignore[assignment]

    def op(self, original: torch.Tensor) -> torch.Tensor:
        if not isinstance(self.value, torch.Tensor):
            return self.value
        _check_broadcast(self, original, self.value)
        value = self.value.to(dtype=original.dtype, device=original.device)
        return value.expand(original.shape) if value.shape != original.shape else value


@dataclass(kw_only=True)
class ProbePatch(Patch):
    """Record the activation passing through (detached clone) in ``activation``; the value is unchanged.

    Attributes:
        activation: the last value seen, or ``None`` before any forward pass.
    """

    activation: Any = field(default=None, repr=False)

    def op(self, original: Any) -> Any:
        self.activation = _detached_clone(original)
        return original

    def __call__(self, original: Any) -> Any:
        if self.slice is None:
            return self.op(original)
        self.activation = _detached_clone(original[self.slice])
        return original


@dataclass(kw_only=True)
class RecordPatch(Patch):
    """Record every activation passing through (one detached clone per call) in ``activations``."""

    activations: list[Any] = field(default_factory=list, repr=False)

    def op(self, original: Any) -> Any:
        self.activations.append(_detached_clone(original))
        return original

    def __call__(self, original: Any) -> Any:
        if self.slice is None:
            return self.op(original)
        self.activations.append(_detached_clone(original[self.slice]))
        return original


@dataclass(kw_only=True)
class CustomPatch(Patch):
    """Apply an arbitrary function: ``custom_op(original) -> new`` (differentiable if the function is)."""

    custom_op: Callable[[Any], Any] = field(default=None)  # type: ignore[assignment]

    def op(self, original: Any) -> Any:
        return self.custom_op(original)


def _detached_clone(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, (tuple, list)):
        return type(value)(_detached_clone(item) for item in value)
    if isinstance(value, dict):
        return {key: _detached_clone(item) for key, item in value.items()}
    return value
