"""Attribution graphs over transcoder features on the op graph (Ameisen et al. 2025, "Circuit Tracing: Revealing
Computational Graphs in Language Models"; circuit-tracer's method and file format).

Example::

    from gradpatch.circuits import ReplacementModel, attribute, prune_graph, save_graph
    replacement = ReplacementModel(pg, {0: transcoder_0, 1: transcoder_1}, ids)   # ids [1, seq], frozen on it
    graph = attribute(replacement)           # graph.adjacency [n, n], rows = targets, columns = sources
    save_graph(graph, "out", decode=tokenizer.decode)

See docs/circuits.md.
"""

from .attribute import AttributionGraph, attribute, salient_logits
from .errors import CircuitError, FrozenNodesNotFoundError, MemoryBoundError
from .files import frontend_graph, node_records, save_graph
from .freeze import FrozenLayerNorm, FrozenNodes, find_frozen_nodes
from .prune import PruneResult, compute_influence, graph_scores, logit_weights, normalize_matrix, prune_graph
from .replacement import ReplacementModel, ReplacementRun, SplicedLayer

__all__ = [
    "AttributionGraph",
    "CircuitError",
    "FrozenLayerNorm",
    "FrozenNodes",
    "FrozenNodesNotFoundError",
    "MemoryBoundError",
    "PruneResult",
    "ReplacementModel",
    "ReplacementRun",
    "SplicedLayer",
    "attribute",
    "compute_influence",
    "find_frozen_nodes",
    "frontend_graph",
    "graph_scores",
    "logit_weights",
    "node_records",
    "normalize_matrix",
    "prune_graph",
    "salient_logits",
    "save_graph",
]
