"""gradpatch: gradient-based interventions on PyTorch models.

The public API follows graphpatch's names and semantics, so ``from gradpatch import PatchableGraph, ZeroPatch``
replaces ``from graphpatch import ...``.
"""

from .errors import (
    CompilationWarning,
    DataDependentControlFlow,
    ExtractionError,
    GradpatchError,
    InputSignatureError,
    NonFiniteError,
    NodePathError,
    PatchShapeError,
    ShapeSpecializationError,
)
from .fingerprint import model_fingerprint
from .graph_modules import CompiledGraphModule, MultiplyInvokedModule, OpaqueGraphModule, UnusedModule
from .intervention import Intervention
from .node_path import NodeData
from .options import ExtractionOptions
from .patchable_graph import PatchableGraph
from .patches import AddPatch, CustomPatch, Patch, ProbePatch, RecordPatch, ReplacePatch, ZeroPatch

__all__ = [
    "AddPatch",
    "CompilationWarning",
    "CompiledGraphModule",
    "CustomPatch",
    "DataDependentControlFlow",
    "ExtractionError",
    "ExtractionOptions",
    "GradpatchError",
    "InputSignatureError",
    "Intervention",
    "MultiplyInvokedModule",
    "NodeData",
    "NodePathError",
    "NonFiniteError",
    "OpaqueGraphModule",
    "Patch",
    "PatchShapeError",
    "PatchableGraph",
    "ProbePatch",
    "RecordPatch",
    "ReplacePatch",
    "ShapeSpecializationError",
    "UnusedModule",
    "ZeroPatch",
    "model_fingerprint",
]
