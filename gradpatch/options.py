"""Options controlling graph extraction (same names and meaning as graphpatch's ``ExtractionOptions``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from torch import nn


@dataclass(frozen=True, kw_only=True)
class ExtractionOptions:
    """How :class:`~gradpatch.PatchableGraph` turns a module hierarchy into graphs.

    Attributes:
        error_on_compilation_failure: raise :class:`~gradpatch.errors.ExtractionError` instead of falling back to
            an :class:`~gradpatch.graph_modules.OpaqueGraphModule` when a module's graph cannot be extracted.
        skip_compilation: extract no graphs at all; every module becomes an ``OpaqueGraphModule`` (only inputs,
            outputs, parameters and buffers are patchable).
        classes_to_skip_compiling: module classes that always become ``OpaqueGraphModule``s.
        custom_extraction_functions: maps a module class to a function ``module -> replacement``; the replacement
            module (same function, same parameters, a forward that is easier to trace) is traced instead.
        warn_on_compilation_failure: emit a ``UserWarning`` naming the module and the reason when a module falls
            back to an ``OpaqueGraphModule``.
    """

    error_on_compilation_failure: bool = False
    skip_compilation: bool = False
    classes_to_skip_compiling: frozenset[type[nn.Module]] = field(default_factory=frozenset)
    custom_extraction_functions: dict[type[nn.Module], Callable[[nn.Module], nn.Module]] = field(default_factory=dict)
    warn_on_compilation_failure: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "classes_to_skip_compiling", frozenset(self.classes_to_skip_compiling))
