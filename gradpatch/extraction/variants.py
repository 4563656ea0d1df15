"""The graphs of a PatchableGraph: one set per kind of call, extracted the first time such a call comes.

A graph holds the Python decisions its example took, so graphs are kept per

- training mode (``self.training`` branches: dropout);
- kind of call: which arguments are graph inputs (tensors, KV caches) and the values of the constant ones
  (``use_cache=False``), so a call with an ``attention_mask`` or a cache the example lacked gets graphs of its own
  instead of graphs that would ignore them;
- class of input sizes (each dimension counted as 1 or larger, the rule torch.compile uses; a KV cache counts as
  empty, one token or more), only for graphs holding a size decision (``if q_len > 1``); a guard in each graph
  still raises :class:`~gradpatch.errors.ShapeSpecializationError` when a call breaks a decision within its class.

Extraction runs the model on the call's own arguments (its KV cache copied, so the caller's is left alone), with
the example's constants for the arguments the call leaves out.
"""

from __future__ import annotations

import copy
import dis
import inspect
import sys
import warnings
from contextlib import nullcontext
from typing import Any, Iterator

import torch
from torch import nn

from ..errors import GradpatchError, InputSignatureError
from .extractor import Extractor
from .graph_modules import CompiledGraphModule
from .options import ExtractionOptions
from ..value_info import holds_input, is_live_object

#: (training, kind of call, class of sizes or None for graphs without size decisions)
VariantKey = tuple[bool, tuple, Any]


class GraphVariants:
    """Extracts and keeps the graphs of ``module`` for each kind of call (see the module docstring).

    Args:
        module: the wrapped model.
        options: extraction options.
        example: ``(args, kwargs)`` of the example call; the graphs of its kind are the ones ``pg.graph`` shows.
    """

    def __init__(self, module: nn.Module, options: ExtractionOptions, example: tuple[tuple, dict]) -> None:
        self._module = module
        self._options = options
        self.example = example
        self._signature = inspect.signature(module.forward)
        self._parameter_names = tuple(self._signature.parameters)
        self._example_call = self._bind(*example[0], **example[1])
        self._ignored = unread_var_keyword(type(module).forward)
        self._variants: dict[VariantKey, nn.Module] = {}
        self._recent: dict[tuple, nn.Module] = {}  # cheap key of a call -> its graphs (skips binding)

    def for_call(self, training: bool, args: tuple, kwargs: dict, warn: bool = True) -> nn.Module:
        """The root wrapper for a call in ``training`` mode, extracted on first use (with a warning unless
        ``warn`` is false).

        Raises:
            InputSignatureError: the arguments do not fit the model's ``forward``.
            ExtractionError: see :class:`~gradpatch.extraction.extractor.Extractor`.
        """
        quick = (training, _quick_kind(args), _quick_kind(kwargs))
        wrapper = self._recent.get(quick)
        if wrapper is not None:
            return wrapper
        call = self._completed(self._bind(*args, **kwargs))
        kind = tuple(sorted((name, _kind(value)) for name, value in call.items() if name != self._ignored))
        wrapper = self._variants.get((training, kind, None))
        if wrapper is None:
            key = (training, kind, _size_class(call))
            wrapper = self._variants.get(key)
            if wrapper is None:
                if warn and any(mode == training and seen == kind for mode, seen, _ in self._variants):
                    warnings.warn(f"gradpatch: extracting graphs for input sizes {key[2]} (the model's code branches "
                                  f"on sizes; once per class of sizes, each dimension 1 or larger)", stacklevel=4)
                elif warn and self._variants:
                    warnings.warn(f"gradpatch: extracting graphs for a new kind of call ({_describe(call)}); once "
                                  f"per training mode and set of inputs and constants", stacklevel=4)
                wrapper, guarded = self._extract(training, call)
                wrapper._gp_call_kind = dict(kind)
                self._variants[key if guarded else (training, kind, None)] = wrapper
        self._recent[quick] = wrapper
        return wrapper

    def check_traced_call(self, wrapper: nn.Module, args: tuple, kwargs: dict) -> None:
        """Check, while ``torch.compile(pg)`` traces a call, that ``wrapper``'s graphs (the ones chosen by the last
        eager call) are of the call's kind: the same inputs, and the same values of the constants it passes.

        Written for dynamo to trace (no binding, no extraction): the constants' values are guarded, so a later call
        with other constants traces again and is checked again.

        Raises:
            GradpatchError: the call needs graphs of another kind; the message names the argument and the fix
                (``pg.compile()``, which chooses graphs outside the compiled region).
        """
        expected: dict[str, Any] = wrapper._gp_call_kind
        given = dict(zip(self._parameter_names, args))
        given.update(kwargs)
        for name, value in given.items():
            if name == self._ignored:
                continue
            want = expected.get(name)
            if isinstance(value, torch.Tensor):
                fits = want is not None and want[0] == "input"
            elif want is not None and want[0] == "constant":
                fits = want[1] == value
            else:
                fits = want is not None or value is None
            if not fits:
                raise GradpatchError(
                    f"torch.compile(pg) runs the graphs of the last eager call's kind, and this call's '{name}' "
                    f"needs other graphs (they had {want!r}); use pg.compile(**torch_compile_kwargs) instead, which "
                    f"chooses the graphs of each call outside the compiled region")

    def example_wrapper(self, training: bool) -> nn.Module:
        """The root wrapper of the example's kind of call (the one ``pg.graph`` draws)."""
        return self.for_call(training, *self.example, warn=False)

    def convert(self, fn: Any) -> None:
        """Convert the example's tensors with ``fn`` (as ``nn.Module._apply`` does) and drop every graph."""
        args, kwargs = self.example
        self.example = (tuple(_convert(fn, value) for value in args),
                        {name: _convert(fn, value) for name, value in kwargs.items()})
        self._example_call = self._bind(*self.example[0], **self.example[1])
        self._variants.clear()
        self._recent.clear()

    def _bind(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        try:
            return dict(self._signature.bind(*args, **kwargs).arguments)
        except TypeError as error:
            raise InputSignatureError(f"the call does not fit {type(self._module).__name__}.forward"
                                      f"{self._signature}: {error}") from error

    def _completed(self, call: dict[str, Any]) -> dict[str, Any]:
        """``call`` with the example's constants (not its tensors) for the arguments it leaves out."""
        for name, value in self._example_call.items():
            if name not in call and not holds_input(value):
                call[name] = value
        return call

    @torch.compiler.disable
    def _extract(self, training: bool, call: dict[str, Any]) -> tuple[nn.Module, bool]:
        """Extract all graphs on ``call``; returns the root wrapper and whether any graph holds a size guard.

        Never traced by ``torch.compile`` (a call that a compiled ``pg`` runs eagerly may extract graphs)."""
        extractor = Extractor(self._options)
        module = self._module
        was_training = module.training
        module.train(training)
        saved = {name: buffer.detach().clone() for name, buffer in module.named_buffers()}
        bound = self._signature.bind_partial()
        bound.arguments.update({name: _isolated(value) for name, value in call.items()})
        try:
            with torch.enable_grad(), _unsaved_activations(), _transformers_extraction():
                wrapper, _ = extractor.extract(module, bound.args, bound.kwargs, "")
            postprocess = self._options.postprocessing_function
            if postprocess is not None:
                postprocess(wrapper, module)
                for graph_module in wrapper.modules():
                    if isinstance(graph_module, CompiledGraphModule):
                        graph_module.recompile()
        finally:
            with torch.no_grad():
                for name, buffer in module.named_buffers():
                    buffer.copy_(saved[name])
            module.train(was_training)
        return wrapper, extractor.guard_count > 0


def unread_var_keyword(function: Any) -> str | None:
    """The name of ``function``'s ``**kwargs`` parameter if its code never reads it, else ``None``.

    A keyword argument that only such a parameter would take has no effect on the call.
    """
    code = getattr(function, "__code__", None)
    if code is None or not code.co_flags & inspect.CO_VARKEYWORDS:
        return None
    name = code.co_varnames[code.co_argcount + code.co_kwonlyargcount + bool(code.co_flags & inspect.CO_VARARGS)]
    if name in code.co_cellvars:
        return None
    read = any(instruction.argval == name for instruction in dis.get_instructions(code)
               if instruction.opname.startswith("LOAD_"))
    return None if read else name


def _kind(value: Any) -> Any:
    """What about one argument decides its graphs: an input (its container structure), or a constant's value."""
    if isinstance(value, torch.Tensor) or is_live_object(value):
        return ("input", type(value).__name__)
    if isinstance(value, (tuple, list)) and holds_input(value):
        return (type(value).__name__, tuple(_kind(item) for item in value))
    if isinstance(value, dict) and holds_input(value):
        return ("dict", tuple(sorted((str(key), _kind(item)) for key, item in value.items())))
    try:
        hash(value)
        return ("constant", value)
    except TypeError:
        return ("constant", repr(value))


def _quick_kind(arguments: Any) -> tuple:
    """A cheap key of positional or keyword arguments: tensors by size class, caches by length class, constants
    by value (by identity when unhashable)."""
    items = arguments.items() if isinstance(arguments, dict) else enumerate(arguments)
    key = []
    for name, value in items:
        if isinstance(value, torch.Tensor):
            key.append((name, "T", tuple(min(size, 2) for size in value.shape)))
        elif is_live_object(value):
            key.append((name, "L", _cache_class(value)))
        else:
            try:
                hash(value)
                key.append((name, "C", value))
            except TypeError:
                key.append((name, "I", id(value)))
    return tuple(key)


def _size_class(call: dict[str, Any]) -> tuple:
    """Each tensor argument's dimensions counted as 1 or larger; each KV cache as empty, one token or more."""
    classes = []
    for name, value in call.items():
        if isinstance(value, torch.Tensor):
            classes.append((name, tuple(min(size, 2) for size in value.shape)))
        elif is_live_object(value):
            classes.append((name, _cache_class(value)))
    return tuple(sorted(classes))


def _cache_class(cache: Any) -> int:
    length = getattr(cache, "get_seq_length", None)
    return min(int(length()), 2) if callable(length) else 0


def _describe(call: dict[str, Any]) -> str:
    parts = []
    for name, value in call.items():
        if isinstance(value, torch.Tensor):
            parts.append(f"{name}: Tensor{tuple(value.shape)}")
        elif is_live_object(value):
            parts.append(f"{name}: {type(value).__name__}")
        elif value is not None:
            parts.append(f"{name}={value!r}")
    return ", ".join(parts)


def _convert(fn: Any, value: Any) -> Any:
    """Apply a module conversion function (which leaves integer tensors' dtype alone) to an example input."""
    return fn(value) if isinstance(value, torch.Tensor) else value


def _isolated(value: Any) -> Any:
    """A live object (KV cache) copied, its tensors detached (extraction runs the model, which would append to the
    caller's cache); any other value as it is."""
    if not is_live_object(value):
        return value
    memo: dict[int, Any] = {id(tensor): tensor.detach().clone() for tensor in _tensors_in(value)}
    return copy.deepcopy(value, memo)


def _tensors_in(value: Any, seen: set[int] | None = None) -> Iterator[torch.Tensor]:
    """The tensors reachable from ``value`` through containers and instance attributes."""
    seen = set() if seen is None else seen
    if id(value) in seen:
        return
    seen.add(id(value))
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list, set)):
        for item in value:
            yield from _tensors_in(item, seen)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors_in(item, seen)
    elif hasattr(value, "__dict__") and not isinstance(value, (type, nn.Module)):
        yield from _tensors_in(vars(value), seen)


def _unsaved_activations() -> Any:
    """Autograd keeps no tensor for a backward pass during the block. Extraction runs in grad mode, so that the
    graphs keep the model's own grad-mode decisions (``torch.no_grad()`` blocks, ``requires_grad`` checks), but its
    output is thrown away, never differentiated; on a large call the activations autograd would save are most of its
    memory (MEMIT's key pass over 1,000 facts on SmolLM2-135M, whose first call on a KV cache carried 372 rows:
    peak RSS 10.9 GB with them, 5.6 GB without)."""

    def unpack(_: None) -> torch.Tensor:
        raise RuntimeError("gradpatch: an extraction pass keeps no activations for a backward pass")

    return torch.autograd.graph.saved_tensors_hooks(lambda _: None, unpack)


def _transformers_extraction() -> Any:
    """transformers' eager mask decisions during extraction (see :mod:`gradpatch.optional.transformers`), when the
    model's code may use them (transformers is imported); importing it otherwise would cost seconds."""
    if "transformers.masking_utils" not in sys.modules:
        return nullcontext()
    from .masks import eager_mask_decisions

    return eager_mask_decisions()
