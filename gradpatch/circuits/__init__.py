"""Attribution graphs over transcoder features on the op graph (Ameisen et al. 2025, "Circuit Tracing: Revealing
Computational Graphs in Language Models"; circuit-tracer's method and file format).

Example::

    from gradpatch.circuits import ReplacementModel, attribute, prune_graph, save_graph
    replacement = ReplacementModel(pg, {0: transcoder_0, 1: transcoder_1}, ids)   # ids [1, seq], frozen on it
    graph = attribute(replacement)           # graph.adjacency [n, n], rows = targets, columns = sources
    save_graph(graph, "out", decode=tokenizer.decode)   # adjacency.safetensors, nodes.json, graph.json, graph.html
    intervene(pg, transcoders, ids, [FeatureEdit(1, 5, 42, "ablate")]).top_after   # the new top logits

See docs/circuits.md.
"""

from .attribute import AttributionGraph, attribute, salient_logits
from .complete import Completeness, check_completeness, completeness, default_tolerance
from .errors import (CircuitError, FeatureIndexError, FrozenNodesNotFoundError, IncompleteGraphError, MemoryBoundError,
                     NoPathError)
from .files import frontend_graph, node_records, save_graph
from .freeze import FrozenLayerNorm, FrozenNodes, LinearisedOp, find_frozen_nodes
from .html import graph_html, node_label
from .intervene import EDIT_KINDS, FeatureEdit, InterventionResult, intervene, intervene_direct, top_logits
from .paths import check_paths
from .prune import (GraphInfluence, PruneResult, compute_influence, graph_influence, graph_scores, logit_weights,
                    normalize_matrix, prune_graph)
from .replacement import ReplacementModel, ReplacementRun, SplicedLayer
from .select import limit_features, visit_order
from .transcoders import LLAMA_MLP_INPUT, LLAMA_MLP_OUTPUT, load_transcoders

__all__ = [
    "AttributionGraph",
    "CircuitError",
    "Completeness",
    "EDIT_KINDS",
    "FeatureEdit",
    "FeatureIndexError",
    "FrozenLayerNorm",
    "FrozenNodes",
    "FrozenNodesNotFoundError",
    "GraphInfluence",
    "IncompleteGraphError",
    "InterventionResult",
    "LLAMA_MLP_INPUT",
    "LLAMA_MLP_OUTPUT",
    "LinearisedOp",
    "MemoryBoundError",
    "NoPathError",
    "PruneResult",
    "ReplacementModel",
    "ReplacementRun",
    "SplicedLayer",
    "attribute",
    "check_completeness",
    "check_paths",
    "completeness",
    "compute_influence",
    "default_tolerance",
    "find_frozen_nodes",
    "frontend_graph",
    "graph_html",
    "graph_influence",
    "graph_scores",
    "intervene",
    "intervene_direct",
    "limit_features",
    "load_transcoders",
    "logit_weights",
    "node_label",
    "node_records",
    "normalize_matrix",
    "prune_graph",
    "salient_logits",
    "save_graph",
    "top_logits",
    "visit_order",
]
