"""Compiled patched forwards: ``pg.compile(**torch_compile_kwargs)``.

``torch.compile`` of a :class:`~gradpatch.patchable_graph.PatchableGraph` must compute what the eager graph computes,
whatever patches are active. :meth:`PatchableGraph.compile` arranges that as follows:

- the graphs for a call are chosen outside the compiled region (extraction and the choice between kinds of call are
  Python that dynamo should not trace), then the chosen root wrapper runs inside it;
- one compiled artefact per *patch set* (the NodePaths, patch kinds and slices of the active patches): each set gets a
  function with a code object of its own, so dynamo keeps its compiled code, guards and recompile budget apart from
  every other set's, and a set that comes back reuses its code without compiling again;
- patch values (tensors, ``nn.Parameter``\\ s, trainable patches' parameters) are read from the patches inside the
  compiled region, so dynamo lifts them to graph inputs: new values, in-place updates and new patch objects with
  values of the same shape run the same code;
- probes and records are stored by the compiled code as they are in eager mode (dynamo replays the stores after the
  graph), so ``ProbePatch.activation`` holds the compiled call's value;
- a patch set that dynamo cannot compile (an ``Unsupported`` error, e.g. ``fullgraph=True`` with a ``CustomPatch``
  whose code breaks the graph) runs eagerly, with a :class:`~gradpatch.errors.CompilationWarning` naming it.

Which graphs are active inside a compiled wrapper is decided by each ``CompiledGraphModule``'s ``_gp_forward``
(see :mod:`gradpatch.extraction.graph_modules`), an instance attribute dynamo guards on.
"""

from __future__ import annotations

import types
import warnings
from typing import Any, Callable, Hashable, Sequence

import torch
from torch import nn

from ._torch_compat import dynamo_unsupported_error
from .errors import CompilationWarning
from .patches import Patch

#: ``(NodePath, patch, node operation)``: an active patch as PatchableGraph keeps it.
ActiveEntry = tuple[str, Patch, str]


def patch_set_key(active: Sequence[Sequence[ActiveEntry]]) -> Hashable:
    """What decides the code of a patched forward: each active patch's NodePath, kind and slice, in order.

    Values are left out on purpose (they are graph inputs); a slice is part of the code (it indexes the value).
    """
    return tuple((path, type(patch), repr(patch.slice)) for entries in active for path, patch, _ in entries)


def _run(wrapper: nn.Module, args: tuple, kwargs: dict) -> Any:
    return wrapper(*args, **kwargs)


class CompiledCalls:
    """The compiled forwards of one PatchableGraph, one per patch set (see the module docstring).

    Args:
        compile_kwargs: keyword arguments of ``torch.compile`` (``backend``, ``mode``, ``fullgraph``, ``dynamic``,
            ``options``); the same for every patch set.
    """

    def __init__(self, compile_kwargs: dict[str, Any]) -> None:
        self.compile_kwargs = dict(compile_kwargs)
        self._functions: dict[Hashable, Callable[..., Any] | None] = {}

    @property
    def patch_sets(self) -> int:
        """How many patch sets have a compiled artefact (or an eager fallback) so far."""
        return len(self._functions)

    def run(self, key: Hashable, wrapper: nn.Module, args: tuple, kwargs: dict) -> Any:
        """Run ``wrapper(*args, **kwargs)`` with the compiled code of patch set ``key`` (compiled on first use).

        Raises:
            whatever the forward raises (a patch's :class:`~gradpatch.errors.PatchShapeError`, say); a patch set
            dynamo cannot compile is run eagerly instead, with a :class:`CompilationWarning`.
        """
        if key not in self._functions:
            self._functions[key] = self._compiled_function(len(self._functions))
            try:
                return self._functions[key](wrapper, args, kwargs)  # type: ignore[misc]
            except dynamo_unsupported_error() as error:
                self._functions[key] = None
                warnings.warn(f"gradpatch: torch.compile cannot compile the forward with the patches at "
                              f"{_describe(key)}, so it runs eagerly (same results, no speed-up): "
                              f"{str(error).splitlines()[0]}", CompilationWarning, stacklevel=4)
        function = self._functions[key]
        if function is None:
            return wrapper(*args, **kwargs)
        return function(wrapper, args, kwargs)

    def _compiled_function(self, index: int) -> Callable[..., Any]:
        """A ``torch.compile``\\ d copy of :func:`_run` whose code object is its own: dynamo keeps compiled code per
        code object, so each patch set has its own cache and recompile limit."""
        code = _run.__code__.replace(co_name=f"patch_set_{index}")
        function = types.FunctionType(code, _run.__globals__, code.co_name)
        return torch.compile(function, **self.compile_kwargs)


def _describe(key: Hashable) -> str:
    names = [f"{path} ({kind.__name__})" for path, kind, _ in key]  # type: ignore[union-attr]
    return ", ".join(names) if names else "no node"
