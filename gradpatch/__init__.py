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
    LayoutError,
    NonFiniteError,
    NodePathError,
    PatchShapeError,
    ShapeSpecializationError,
    SubspaceConfigError,
)
from .fingerprint import model_fingerprint
from .graph_modules import CompiledGraphModule, MultiplyInvokedModule, OpaqueGraphModule, UnusedModule
from .interchange import InterchangeSide, interchange
from .intervention import Intervention
from .node_path import NodeData
from .options import ExtractionOptions
from .layouts import ModelLayout
from .patchable_graph import PatchableGraph
from .patches import AddPatch, CustomPatch, Patch, ProbePatch, RecordPatch, ReplacePatch, ZeroPatch
from .reft import AddVectorPatch, DiReFTPatch, LoReFTPatch, ReFTPatch, ReFTPositions
from .subspace import (BoundlessSubspacePatch, FullInterchangePatch, RotatedSubspacePatch, SigmoidMaskPatch,
                       TrainablePatch)

__all__ = [
    "AddPatch",
    "AddVectorPatch",
    "DiReFTPatch",
    "LoReFTPatch",
    "ReFTPatch",
    "ReFTPositions",
    "BoundlessSubspacePatch",
    "CompilationWarning",
    "CompiledGraphModule",
    "CustomPatch",
    "DataDependentControlFlow",
    "ExtractionError",
    "ExtractionOptions",
    "FullInterchangePatch",
    "GradpatchError",
    "InputSignatureError",
    "InterchangeSide",
    "Intervention",
    "LayoutError",
    "ModelLayout",
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
    "RotatedSubspacePatch",
    "ShapeSpecializationError",
    "SigmoidMaskPatch",
    "SubspaceConfigError",
    "TrainablePatch",
    "UnusedModule",
    "ZeroPatch",
    "interchange",
    "model_fingerprint",
]
