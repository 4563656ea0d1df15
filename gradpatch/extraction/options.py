"""Options controlling graph extraction (same names and meaning as graphpatch's ``ExtractionOptions``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Union

from torch import fx, nn

#: A custom extraction function: ``module -> fx.Graph`` (graphpatch's form; ``get_attr``/``call_module`` targets
#: resolve against the module) or ``module -> replacement module`` (traced instead of the module).
CustomExtraction = Callable[[nn.Module], Union[fx.Graph, nn.Module]]


@dataclass(kw_only=True)
class ExtractionOptions:
    """How :class:`~gradpatch.PatchableGraph` turns a module hierarchy into graphs.

    Attributes:
        allow_unused_submodules: accept submodules of a compiled module that the example inputs never call (they
            stand as :class:`~gradpatch.extraction.UnusedModule`). Default: ``not error_on_compilation_failure``;
            in strict mode an unused submodule raises :class:`~gradpatch.errors.ExtractionError`.
        classes_to_skip_compiling: module classes that always become ``OpaqueGraphModule``s.
        copy_transformers_generation_config: copy a transformers model's ``config`` and ``generation_config``
            onto the PatchableGraph (``pg.config``, ``pg.generation_config``, used by ``pg.generate``).
        custom_extraction_functions: maps a module class to a function ``module -> fx.Graph`` (the graph to use
            for it; its submodule calls run unwrapped) or ``module -> replacement module`` (same function and
            parameters, a forward that is easier to trace; traced instead).
        error_on_compilation_failure: raise :class:`~gradpatch.errors.ExtractionError` instead of falling back to
            an :class:`~gradpatch.extraction.graph_modules.OpaqueGraphModule` when a module's graph cannot be extracted.
        postprocessing_function: ``fn(root_wrapper, original_module)`` called after extraction; it may edit the
            graphs in place (they are recompiled afterwards).
        skip_compilation: extract no graphs at all; every module becomes an ``OpaqueGraphModule`` (only inputs,
            attributes, parameters, buffers and outputs are patchable).
        warn_on_compilation_failure: emit a :class:`~gradpatch.errors.CompilationWarning` naming the module and
            the reason when a module falls back to an ``OpaqueGraphModule`` or a submodule is never called.
    """

    allow_unused_submodules: Optional[bool] = None
    classes_to_skip_compiling: frozenset[type[nn.Module]] = field(default_factory=frozenset)
    copy_transformers_generation_config: bool = True
    custom_extraction_functions: dict[type[nn.Module], CustomExtraction] = field(default_factory=dict)
    error_on_compilation_failure: bool = False
    postprocessing_function: Optional[Callable[[nn.Module, nn.Module], None]] = None
    skip_compilation: bool = False
    warn_on_compilation_failure: bool = False

    def __post_init__(self) -> None:
        self.classes_to_skip_compiling = frozenset(self.classes_to_skip_compiling)
        if self.allow_unused_submodules is None:
            self.allow_unused_submodules = not self.error_on_compilation_failure
