"""Extraction: turning a module's forward pass into fx graphs whose nodes are named tensor operations.

The room behind :class:`~gradpatch.patchable_graph.PatchableGraph`: ``extractor.py`` (the recursive extraction of every
submodule), ``tracer.py`` (the value-carrying fx tracer and its size guards), ``graph_modules.py`` (the wrappers:
compiled graphs, opaque fallbacks, multiply invoked modules), ``variants.py`` (graphs per kind of call),
``node_path.py`` (the navigable NodePath tree), ``options.py`` (``ExtractionOptions``), and their helpers
(``attributes``, ``dispatch`` for accelerate's hooks, ``graph_code``, ``hierarchy``, ``inputs``, ``masks``,
``naming``, ``variable_names``). ``graphpatch.extraction``'s public names are here.
"""

from .extractor import Extractor
from .graph_modules import CompiledGraphModule, MultiplyInvokedModule, OpaqueGraphModule, UnusedModule
from .node_path import NodeData
from .options import ExtractionOptions

__all__ = ["CompiledGraphModule", "ExtractionOptions", "Extractor", "MultiplyInvokedModule", "NodeData",
           "OpaqueGraphModule", "UnusedModule"]
