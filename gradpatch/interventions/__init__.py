"""Trainable interventions: patches with parameters and the files that hold them.

``subspace.py`` (DAS, Boundless DAS, sigmoid masks, full interchange), ``reft.py`` (LoReFT, DiReFT, steering vectors),
``interchange.py`` (base and source runs in one batch) and ``intervention.py`` (``Intervention``: trainable patches as
one ``nn.Module``, saved as safetensors + JSON).
"""

from .interchange import InterchangeSide, interchange
from .intervention import Intervention
from .reft import AddVectorPatch, DiReFTPatch, LoReFTPatch, ReFTPatch, ReFTPositions
from .subspace import (BoundlessSubspacePatch, FullInterchangePatch, RotatedSubspacePatch, SigmoidMaskPatch,
                       TrainablePatch)

__all__ = ["AddVectorPatch", "BoundlessSubspacePatch", "DiReFTPatch", "FullInterchangePatch", "InterchangeSide",
           "Intervention", "LoReFTPatch", "ReFTPatch", "ReFTPositions", "RotatedSubspacePatch", "SigmoidMaskPatch",
           "TrainablePatch", "interchange"]
