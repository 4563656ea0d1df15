"""Patches: functions that change or record the value seen downstream of a graph node.

The classes and their semantics follow graphpatch (``ZeroPatch``, ``AddPatch``, ``ReplacePatch``, ``ProbePatch``,
``RecordPatch``, ``CustomPatch``; ``Patch[T]`` is generic, so ``class MyPatch(Patch[torch.Tensor])`` works), and
``HoldPatch`` keeps the live value, with its autograd history, for code that reads it later. Every patch is a
keyword-only dataclass with ``op(original) -> new``. With ``slice`` set, ``op`` sees ``original[slice]`` and its
result is written into a copy of ``original`` at ``slice``; the copy keeps autograd intact, so gradients flow to
patch values (tensors that require grad or ``nn.Parameter``s) and to the unpatched part of the activation alike.
The reading patches (``ProbePatch``, ``RecordPatch``, ``HoldPatch`` without ``leaf``) read ``original[slice]`` and
pass the value on uncopied.

A patch never changes the model: a patch whose ``requires_clone`` is true (``CustomPatch`` and user subclasses, by
default) receives a copy it may modify in place, so a weight or a value that autograd saved stays intact. The
built-in patches compute out of place and skip the copy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from numbers import Number
from typing import Any, Callable, Generic, TypeVar

import torch

from .errors import NonFiniteError, PatchShapeError
from .positions import Tokens
from .value_info import ValueInfo

#: What a ``slice`` may hold: anything valid inside ``tensor[...]`` (ints, slices, ``Ellipsis``, ``None``,
#: index tensors, or tuples and lists of those).
Slice = Any

#: What a patch receives and returns (``Patch[torch.Tensor]``, as in graphpatch).
PatchTarget = TypeVar("PatchTarget")

#: A patch value: a tensor (which may require grad) or a Python number.
PatchValue = Any


@dataclass(kw_only=True)
class Patch(Generic[PatchTarget]):
    """Base class: identity. Subclasses override :meth:`op`.

    Attributes:
        slice: optional index expression; ``op`` then applies to ``original[slice]`` only.
        requires_clone: whether ``op`` may modify its argument in place, so that it must receive a copy (true
            for subclasses unless they say otherwise).
    """

    slice: Slice = None
    requires_clone: bool = field(default=True, init=False, repr=False)

    def op(self, original: Any) -> Any:
        """Return the value seen downstream instead of ``original``."""
        return original

    def __call__(self, original: Any) -> Any:
        if self.slice is None:
            return self.op(_clone(original) if self.requires_clone else original)
        if not isinstance(original, torch.Tensor):
            raise TypeError(
                f"{type(self).__name__} has slice={self.slice!r} but the patched value is a "
                f"{type(original).__name__}, not a tensor; dig to a tensor with '|sub_i' in the NodePath"
            )
        index = _index(self, original)
        if index is _NOTHING:
            return original
        patched = original.clone()
        patched[index] = self.op(_indexed(self, patched, index))
        return patched


#: :func:`_index`'s answer when a :class:`~gradpatch.positions.Tokens` slice selects no token of this pass.
_NOTHING = object()


def _index(patch: Patch, value: torch.Tensor) -> Any:
    """The index expression of ``patch.slice`` for ``value``: a :class:`~gradpatch.positions.Tokens` resolved in the
    current forward pass (:data:`_NOTHING` when it selects no token), a list holding slices or ``Ellipsis``
    (``[1, ...]``, graphpatch's spelling) as a tuple index, anything else as it is.

    Raises:
        PatchShapeError: a ``Tokens`` dimension that ``value`` does not have.
    """
    index = patch.slice
    if isinstance(index, Tokens):
        try:
            resolved = index.index(value)
        except IndexError as error:
            raise PatchShapeError(f"{type(patch).__name__}: {error}") from error
        return _NOTHING if resolved is None else resolved
    if isinstance(index, list) and any(isinstance(item, (slice, tuple, type(Ellipsis))) or item is None
                                       for item in index):
        return tuple(index)
    return index


def _indexed(patch: Patch, value: torch.Tensor, index: Any) -> Any:
    """``value[index]``.

    Raises:
        PatchShapeError: the slice does not index ``value`` (the message gives both).
    """
    try:
        return value[index]
    except IndexError as error:
        raise PatchShapeError(f"{type(patch).__name__} slice {patch.slice!r} does not index an activation of shape "
                              f"{tuple(value.shape)}: {error}") from error


def _check_value(patch: Patch, value: Any) -> None:
    if not isinstance(value, (torch.Tensor, Number)):
        raise TypeError(f"{type(patch).__name__}(value=...) takes a tensor or a Python number, got "
                        f"{type(value).__name__}; e.g. {type(patch).__name__}(value=torch.zeros(576))")


def check_value_shape(path: str, patch: Patch, info: ValueInfo | None, operation: str) -> None:
    """Before any forward pass, check that a tensor value of ``patch`` can broadcast to the value at NodePath
    ``path`` (example shape in ``info``, node operation ``operation``). A weight or buffer (a ``get_attr`` node
    or an opaque module's attribute) must match its whole shape; an activation, whose leading sizes vary between
    calls, its last dimension.

    Raises:
        PatchShapeError: the value cannot broadcast (the message gives both shapes).
        SubspaceConfigError: a trainable subspace patch whose width is not the node's last dimension.
    """
    check_width = getattr(patch, "check_width", None)  # trainable subspace patches (gradpatch.interventions.subspace)
    if callable(check_width) and info is not None and info.shape:
        check_width(int(info.shape[-1]), path)
    value = getattr(patch, "value", None)
    if not isinstance(value, torch.Tensor) or patch.slice is not None or info is None or info.shape is None:
        return
    shape = tuple(info.shape)
    fixed = operation.startswith(("get_attr", "attribute")) or not shape
    compared = shape if fixed else shape[-1:]
    trailing = tuple(value.shape)[-len(compared):] if compared else ()
    wide = len(value.shape) > len(shape)
    if wide or any(size not in (1, expected) for size, expected in zip(reversed(trailing), reversed(compared))):
        raise PatchShapeError(
            f"{type(patch).__name__} value of shape {tuple(value.shape)} cannot broadcast to '{path}', of shape "
            f"{shape} on the example inputs; give a value of shape {shape[-1:] if not fixed else shape} (or one "
            f"that broadcasts to it), or a slice")


@dataclass(kw_only=True)
class FiniteCheck(Patch):
    """Raises :class:`~gradpatch.errors.NonFiniteError` when the value at its node holds NaN or ±inf (what
    ``pg.patch(..., check_finite=True)`` adds after the patches of each patched node).

    Attributes:
        path: the NodePath, named in the error.
    """

    path: str
    requires_clone: bool = field(default=False, init=False, repr=False)

    def op(self, original: Any) -> Any:
        tensors = [original] if isinstance(original, torch.Tensor) else [
            item for item in (original.values() if isinstance(original, dict) else original)
            if isinstance(item, torch.Tensor)] if isinstance(original, (tuple, list, dict)) else []
        for tensor in tensors:
            if tensor.is_floating_point() and not bool(torch.isfinite(tensor.detach()).all()):
                raise NonFiniteError(f"the patched value at '{self.path}' holds NaN or ±inf: check the patch values "
                                     f"there (a learned delta that diverged, a division by zero)")
        return original


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
    """Replace the activation (or ``activation[slice]``) by zeros (``0`` for a Python number)."""

    requires_clone: bool = field(default=False, init=False, repr=False)

    def op(self, original: Any) -> Any:
        return torch.zeros_like(original) if isinstance(original, torch.Tensor) else 0


@dataclass(kw_only=True)
class AddPatch(Patch):
    """Add ``value`` to the activation: ``original + value`` (broadcasting; value may require grad).

    Attributes:
        value: a tensor broadcastable to the activation (or to ``activation[slice]``), e.g. ``[d_model]`` for a
            steering vector added at every position of a ``[batch, seq, d_model]`` residual stream; or a number.

    Raises:
        TypeError: at construction, for a missing value or one that is neither a tensor nor a number.
        PatchShapeError: in the forward pass, for a tensor value that does not broadcast to the activation.
    """

    value: PatchValue
    requires_clone: bool = field(default=False, init=False, repr=False)

    def __post_init__(self) -> None:
        _check_value(self, self.value)

    def op(self, original: Any) -> Any:
        value = self.value
        if not isinstance(value, torch.Tensor) or not isinstance(original, torch.Tensor):
            return original + value
        _check_broadcast(self, original, value)
        return original + value.to(dtype=original.dtype, device=original.device)


@dataclass(kw_only=True)
class ReplacePatch(Patch):
    """Replace the activation by ``value`` (broadcast to the activation's shape).

    Attributes:
        value: a tensor broadcastable to the activation (or ``activation[slice]``), which may require grad; or a
            number (every element becomes that number).

    Raises:
        TypeError: at construction, for a missing value or one that is neither a tensor nor a number.
        PatchShapeError: in the forward pass, for a tensor value that does not broadcast to the activation.
    """

    value: PatchValue
    requires_clone: bool = field(default=False, init=False, repr=False)

    def __post_init__(self) -> None:
        _check_value(self, self.value)

    def op(self, original: Any) -> Any:
        value = self.value
        if not isinstance(original, torch.Tensor):
            return value
        if not isinstance(value, torch.Tensor):
            return torch.full_like(original, value)
        _check_broadcast(self, original, value)
        # contiguous(): a broadcast value must not reach later code as a view (``.view()`` would reject it).
        return value.to(dtype=original.dtype, device=original.device).expand(original.shape).contiguous()


@dataclass(kw_only=True)
class _ReadingPatch(Patch):
    """Base of the patches that read the value passing through (``value[slice]`` with a ``slice``; nothing when a
    :class:`~gradpatch.positions.Tokens` slice selects no token of the pass) and pass it on unchanged, uncopied.
    Subclasses implement :meth:`read`."""

    requires_clone: bool = field(default=False, init=False, repr=False)

    def read(self, value: Any) -> None:
        """Take ``value`` (the activation, or its slice); called once per forward pass through the node."""
        raise NotImplementedError

    def op(self, original: Any) -> Any:
        self.read(original)
        return original

    def __call__(self, original: Any) -> Any:
        if self.slice is None:
            return self.op(original)
        index = _index(self, original)
        if index is not _NOTHING:
            self.read(_indexed(self, original, index))
        return original


@dataclass(kw_only=True)
class ProbePatch(_ReadingPatch):
    """Record the activation passing through (detached clone) in ``activation``; the value is unchanged.

    Attributes:
        activation: the last value seen, or ``None`` before any forward pass.
    """

    activation: Any = field(default=None, repr=False)

    def read(self, value: Any) -> None:
        self.activation = _detached_clone(value)


@dataclass(kw_only=True)
class RecordPatch(_ReadingPatch):
    """Record every activation passing through (one detached clone per call) in ``activations``."""

    activations: list[Any] = field(default_factory=list, repr=False)

    def read(self, value: Any) -> None:
        self.activations.append(_detached_clone(value))


@dataclass(kw_only=True, eq=False)
class HoldPatch(_ReadingPatch):
    """Hold the live value passing through, with its autograd history (not detached, not copied), in ``held``, for
    code that runs after the forward pass or later in it: another patch that reads it (a transcoder's input), a
    loss on an intermediate value, ``torch.autograd.grad(..., held)`` for the gradient at the node.

    Without ``leaf`` the value passes on unchanged. With ``leaf`` the patch holds and passes on
    ``original.detach().requires_grad_()`` (the sliced part only, with a ``slice``): the model downstream computes
    from that leaf, so ``torch.autograd.grad(outputs, held)`` is the gradient at the node, and no gradient flows
    upstream of it.

    Example::

        hold = HoldPatch()
        with pg.patch({"model.layers_1.output": hold}):
            loss = pg(ids).logits.logsumexp(-1).sum()
        (gradient,) = torch.autograd.grad(loss, hold.held)      # [batch, seq, d_model]

    Attributes:
        leaf: make the held value a leaf that requires grad (see above).
        held: the value of the last forward pass through the node (``[batch, seq, ...]``, or ``value[slice]``;
            left as it was by a pass whose ``Tokens`` slice selects no token), ``None`` before any; a reader may
            reset it to ``None`` to take it once. Not named ``value``: the
            engine reads a patch's ``value`` as a patch value to check and to train.
    """

    leaf: bool = False
    held: Any = field(default=None, repr=False)

    def read(self, value: Any) -> None:
        self.held = value

    def op(self, original: Any) -> Any:
        if self.leaf:
            original = original.detach().requires_grad_()
        self.held = original
        return original

    def __call__(self, original: Any) -> Any:
        return Patch.__call__(self, original) if self.leaf else super().__call__(original)


@dataclass(kw_only=True)
class CustomPatch(Patch):
    """Apply an arbitrary function: ``custom_op(original) -> new`` (differentiable if the function is).

    Attributes:
        custom_op: the function. It receives a copy it may modify in place unless ``requires_clone=False`` (for
            functions that do not, to save the copy).

    Raises:
        TypeError: at construction, when ``custom_op`` is missing or not callable.
    """

    custom_op: Callable[[Any], Any]
    requires_clone: bool = True

    def __post_init__(self) -> None:
        if not callable(self.custom_op):
            raise TypeError(f"CustomPatch(custom_op=...) takes a function, got {type(self.custom_op).__name__}")

    def op(self, original: Any) -> Any:
        return self.custom_op(original)


def _clone(value: Any) -> Any:
    """A copy of every tensor in ``value`` (nested tuples, lists and dicts), with autograd history kept."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, (tuple, list)):
        items = [_clone(item) for item in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    if isinstance(value, dict):
        return {key: _clone(item) for key, item in value.items()}
    return value


def _detached_clone(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, (tuple, list)):
        return type(value)(_detached_clone(item) for item in value)
    if isinstance(value, dict):
        return {key: _detached_clone(item) for key, item in value.items()}
    return value
