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
- a patch set that dynamo cannot compile runs eagerly, with a :class:`~gradpatch.errors.CompilationWarning` naming
  it and the error: any error dynamo raises (``torch._dynamo.exc.TorchDynamoException``: ``Unsupported``, e.g.
  ``fullgraph=True`` with a ``CustomPatch`` whose code breaks the graph; ``TorchRuntimeError``, an op that fails on
  fake tensors; ``BackendCompilerFailed``, ...), on its first call or on a later recompile. The forward is then
  run eagerly: its result is returned (the same as without ``torch.compile``) and the set stays eager from then on;
  if the eager forward raises too, its error is the caller's (a patch of the wrong shape, say) and the set is
  compiled again on its next call.

Mixture-of-experts layers compile as well: extraction swaps ``torch._grouped_mm``, whose fake kernel dynamo rejects
for dtypes other than bfloat16, for an exact compilable stand-in (:mod:`gradpatch.extraction.compilable_ops`).

Which graphs are active inside a compiled wrapper is decided by each ``CompiledGraphModule``'s ``_gp_forward``
(see :mod:`gradpatch.extraction.graph_modules`), an instance attribute dynamo guards on.
"""

from __future__ import annotations

import types
import warnings
from typing import Any, Callable, Hashable, Sequence

import torch
from torch import nn

from ._torch_compat import dynamo_error
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

        A dynamo error (``torch._dynamo.exc.TorchDynamoException``) on any call of a set runs that call eagerly; if
        it succeeds, the set runs eagerly from then on, with a :class:`CompilationWarning` naming the set and the
        error (once per set).

        Raises:
            whatever the eager forward raises (a patch's :class:`~gradpatch.errors.PatchShapeError`, say), whether
            dynamo ran it or refused it; never a dynamo error.
        """
        if key not in self._functions:
            self._functions[key] = self._compiled_function(len(self._functions))
        function = self._functions[key]
        if function is None:
            return wrapper(*args, **kwargs)
        try:
            return function(wrapper, args, kwargs)
        except dynamo_error() as error:
            output = wrapper(*args, **kwargs)  # raises the forward's own error, if it has one
            self._functions[key] = None
            warnings.warn(f"gradpatch: torch.compile cannot compile the forward with the patches at "
                          f"{_describe(key)}, so it runs eagerly (same results, no speed-up): {_reason(error)}",
                          CompilationWarning, stacklevel=5)
            return output

    def _compiled_function(self, index: int) -> Callable[..., Any]:
        """A ``torch.compile``\\ d copy of :func:`_run` whose code object is its own: dynamo keeps compiled code per
        code object, so each patch set has its own cache and recompile limit."""
        code = _run.__code__.replace(co_name=f"patch_set_{index}")
        function = types.FunctionType(code, _run.__globals__, code.co_name)
        return torch.compile(function, **self.compile_kwargs)


def _describe(key: Hashable) -> str:
    names = [f"{path} ({kind.__name__})" for path, kind, _ in key]  # type: ignore[union-attr]
    return ", ".join(names) if names else "no node"


def _reason(error: BaseException) -> str:
    """``Type: first line`` of a dynamo error, with dynamo's explanation (which names the failing op's own error,
    e.g. ``got RuntimeError('Expected inputs of BF16 type ...')``, at its end) and the error it wraps, if any."""
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    reason = f"{type(error).__name__}: {lines[0] if lines else ''}"
    explanation = next((line.removeprefix("Explanation:").strip() for line in lines[1:]
                        if line.startswith("Explanation:")), "")
    if len(explanation) > 300:  # an op's arguments, then ": got <its error>"
        _, got, tail = explanation.rpartition(": got ")
        explanation = f"got {tail}" if got else f"...{explanation[-300:]}"
    if explanation:
        reason += f" ({explanation})"
    cause = error.__cause__
    if cause is not None and str(cause).strip() and str(cause).strip().splitlines()[0] not in reason:
        reason += f" [{type(cause).__name__}: {str(cause).strip().splitlines()[0]}]"
    return reason
