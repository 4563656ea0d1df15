"""Exception types raised by the patch engine."""

from __future__ import annotations


class GradpatchError(Exception):
    """Base class of gradpatch's own errors."""


class ExtractionError(GradpatchError):
    """A module's graph could not be extracted (data-dependent control flow, grad-mode changes, ...).

    Raised to the caller only with ``ExtractionOptions(error_on_compilation_failure=True)``; otherwise the
    module falls back to an :class:`~gradpatch.graph_modules.OpaqueGraphModule`.
    """


class DataDependentControlFlow(ExtractionError):
    """Python control flow depends on tensor values (``if x.sum() > 0:``, ``x.item()``), so no single graph exists."""


class PatchShapeError(GradpatchError, ValueError):
    """A patch value cannot be combined with the activation it patches (the message gives both shapes)."""


class InputSignatureError(GradpatchError, TypeError):
    """A call passes arguments that differ in kind from the example inputs the graph was extracted with."""


class ShapeSpecializationError(GradpatchError, RuntimeError):
    """A call's shapes change a Python decision that the model's code made on the example's shapes."""
