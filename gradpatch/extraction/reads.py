"""Which instance state a module's code reads while it traces, and comparable tokens of values.

:class:`ReadRecording` records every attribute read on a module and the modules below it (and the call-site copies
its trace runs on) while its code runs, through a ``__getattribute__`` put on their classes for the duration;
torch's and gradpatch's own reads of ``__dict__`` (``nn.Module.__getattr__`` looking for a parameter) are not the
model's and are left out. Tokens describe what a trace can see of a value: tensors by metadata, containers by
structure, Python scalars by value, any other object by identity. :mod:`gradpatch.extraction.reuse` compares them.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn

from .variable_names import LIBRARY_DIRS

__all__ = ["ReadRecording", "attribute_token", "submodule", "tensor_token", "value_token"]

#: nn.Module's own bookkeeping attributes (registries, hooks): read by torch and fx machinery, never deciding a
#: graph (``training`` does, and is compared like any attribute).
_MODULE_INTERNALS = frozenset(nn.Module().__dict__) - {"training"} | {"__class__"}
#: Python values compared by value (exact types only: a subclass may compare otherwise).
_SCALAR_TYPES = (type(None), bool, int, str, bytes, torch.dtype, torch.device, torch.layout, torch.memory_format)


# --- tokens: what a trace may depend on, in comparable form ---------------------------------------------------


class _Same:
    """Compares equal only to a token of the very same object (kept alive by the token)."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Same) and other.value is self.value

    def __hash__(self) -> int:
        return id(self.value)


def tensor_token(tensor: torch.Tensor) -> tuple:
    """The metadata a trace can see of a tensor (its values it cannot: branching on them is refused)."""
    strided = tensor.layout is torch.strided
    return (type(tensor), tuple(tensor.shape), tensor.dtype, tensor.device, tensor.layout, tensor.requires_grad,
            tensor.is_leaf, tensor.stride() if strided else None, tensor.storage_offset() if strided else None,
            tensor.is_conj(), tensor.is_neg())


def value_token(value: Any) -> Any:
    """A comparable description of a value: tensors by metadata, containers by structure, Python scalars by value
    (floats by ``repr``: ``-0.0`` and ``nan`` included), any other object by identity."""
    kind = type(value)
    if kind in _SCALAR_TYPES:
        return (kind, value)
    if kind is float or kind is complex:
        return (kind, repr(value))
    if isinstance(value, torch.Tensor):
        return tensor_token(value)
    if kind is tuple or kind is list or kind is torch.Size or (isinstance(value, tuple) and hasattr(value, "_fields")):
        return (kind, tuple(value_token(item) for item in value))
    if kind is dict:
        return (kind, tuple((value_token(key), value_token(item)) for key, item in value.items()))
    return _Same(value)


def attribute_token(module: nn.Module, name: str) -> Any:
    """What reading ``module.<name>`` gives, as a token: an instance attribute's value, a parameter's or buffer's
    metadata, a submodule's class, or nothing (the class's own attribute, the same for every instance)."""
    state = object.__getattribute__(module, "__dict__")
    if name in state:
        return ("attribute", value_token(state[name]))
    for registry in ("_parameters", "_buffers"):
        entries = state.get(registry) or {}
        if name in entries:
            item = entries[name]
            return (registry, None if item is None else tensor_token(item))
    children = state.get("_modules") or {}
    if name in children:
        return ("module", None if children[name] is None else type(children[name]))
    return ("class",)


# --- recording attribute reads ------------------------------------------------------------------------------

#: id(watched object) -> the recordings it reports to.
_WATCHERS: dict[int, list["ReadRecording"]] = {}
#: class -> [its own ``__getattribute__`` before (or _ABSENT), number of recordings using it]
_INSTALLED: dict[type, list[Any]] = {}
_ABSENT = object()


def _install(cls: type) -> None:
    entry = _INSTALLED.get(cls)
    if entry is not None:
        entry[1] += 1
        return
    previous = cls.__getattribute__

    def __getattribute__(self: Any, name: str) -> Any:
        recordings = _WATCHERS.get(id(self))
        if recordings and (name != "__dict__" or not _library_caller()):
            for recording in recordings:
                if recording.active:
                    recording.reads.add((recording.paths[id(self)], name))
        return previous(self, name)

    _INSTALLED[cls] = [cls.__dict__.get("__getattribute__", _ABSENT), 1]
    cls.__getattribute__ = __getattribute__  # type: ignore[method-assign]


def _library_caller() -> bool:
    """Whether the code reading an attribute (two frames up) is torch's or gradpatch's: ``nn.Module.__getattr__``
    reads ``__dict__`` to find a parameter, the model's code reading ``self.__dict__`` is another matter."""
    return sys._getframe(2).f_code.co_filename.startswith(LIBRARY_DIRS)


def _uninstall(cls: type) -> None:
    entry = _INSTALLED[cls]
    entry[1] -= 1
    if entry[1]:
        return
    del _INSTALLED[cls]
    if entry[0] is _ABSENT:
        delattr(cls, "__getattribute__")
    else:
        cls.__getattribute__ = entry[0]  # type: ignore[method-assign]


class ReadRecording:
    """Records the attributes read on a module and the modules below it (and their call-site copies) while
    :attr:`active`; :meth:`stop` ends it.

    Args:
        module: the module being traced.
        copies: ``(copy, dotted path below module)`` for the shallow copies its trace runs on.
    """

    def __init__(self, module: nn.Module, copies: list[tuple[nn.Module, str]]) -> None:
        self.module = module
        self.reads: set[tuple[str, str]] = set()
        self.active = False
        watched = [(child, path) for path, child in module.named_modules(remove_duplicate=False)] + copies
        self.paths = {id(item): path for item, path in watched}
        self._objects = [item for item, _ in watched]  # keeps the ids valid while watched
        self._classes: list[type] = []
        for item in self._objects:
            _WATCHERS.setdefault(id(item), []).append(self)
        try:
            for cls in dict.fromkeys(type(item) for item in self._objects):
                _install(cls)
                self._classes.append(cls)
        except (TypeError, AttributeError):  # a class that takes no new attributes: nothing is recorded
            self.stop()
            raise

    def stop(self) -> None:
        """Stop recording and restore the classes."""
        self.active = False
        for cls in self._classes:
            _uninstall(cls)
        for item in self._objects:
            recordings = _WATCHERS[id(item)]
            recordings.remove(self)
            if not recordings:
                del _WATCHERS[id(item)]

    def tokens(self) -> tuple[tuple[str, str, Any], ...] | None:
        """``(path, name, token)`` of every relevant read, sorted; ``None`` when the code read a module's whole
        ``__dict__`` (no single attribute can then be said to decide the graph)."""
        tokens = []
        for path, name in sorted(self.reads):
            if name in _MODULE_INTERNALS:
                continue
            if name == "__dict__":
                return None
            target = submodule(self.module, path)
            if target is None:
                return None
            tokens.append((path, name, attribute_token(target, name)))
        return tuple(tokens)


def submodule(module: nn.Module, path: str) -> nn.Module | None:
    """The module at dotted ``path`` below ``module`` through the registries only (``""``: ``module``); ``None``
    if there is none."""
    for part in path.split(".") if path else ():
        module = (object.__getattribute__(module, "__dict__").get("_modules") or {}).get(part)
        if module is None:
            return None
    return module
