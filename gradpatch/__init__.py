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
from .capture import node_activations
from .files.fingerprint import model_fingerprint
from .extraction.graph_modules import CompiledGraphModule, MultiplyInvokedModule, OpaqueGraphModule, UnusedModule
from .interventions.interchange import InterchangeSide, interchange
from .interventions.intervention import Intervention
from .extraction.node_path import NodeData
from .extraction.options import ExtractionOptions
from .layouts import ModelLayout
from .patchable_graph import PatchableGraph
from .patches import AddPatch, CustomPatch, HoldPatch, Patch, ProbePatch, RecordPatch, ReplacePatch, ZeroPatch
from .interventions.reft import AddVectorPatch, DiReFTPatch, LoReFTPatch, ReFTPatch, ReFTPositions
from .interventions.subspace import (BoundlessSubspacePatch, FullInterchangePatch, RotatedSubspacePatch,
                                     SigmoidMaskPatch,
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
    "HoldPatch",
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
    "node_activations",
]
