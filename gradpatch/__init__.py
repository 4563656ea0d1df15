"""gradpatch: gradient-based interventions on PyTorch models.

The public API follows graphpatch's names and semantics, so ``from gradpatch import PatchableGraph, ZeroPatch``
replaces ``from graphpatch import ...``.
"""

from .errors import (
    DataDependentControlFlow,
    ExtractionError,
    GradpatchError,
    InputSignatureError,
    PatchShapeError,
    ShapeSpecializationError,
)
from .fingerprint import model_fingerprint
from .graph_modules import CompiledGraphModule, MultiplyInvokedModule, OpaqueGraphModule
from .intervention import Intervention
from .node_path import NodeData
from .options import ExtractionOptions
from .patchable_graph import PatchableGraph
from .patches import AddPatch, CustomPatch, Patch, ProbePatch, RecordPatch, ReplacePatch, ZeroPatch

__all__ = [
    "AddPatch",
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
    "OpaqueGraphModule",
    "Patch",
    "PatchShapeError",
    "PatchableGraph",
    "ProbePatch",
    "RecordPatch",
    "ReplacePatch",
    "ShapeSpecializationError",
    "ZeroPatch",
    "model_fingerprint",
]
