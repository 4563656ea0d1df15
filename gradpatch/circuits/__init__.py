"""Attribution graphs over transcoder features on the op graph (Ameisen et al. 2025, "Circuit Tracing: Revealing
Computational Graphs in Language Models"; circuit-tracer's method and file format).

Example::

    from gradpatch.circuits import ReplacementModel, attribute, prune_graph, save_graph
    replacement = ReplacementModel(pg, {0: transcoder_0, 1: transcoder_1}, ids)   # ids [1, seq], frozen on it
    graph = attribute(replacement)           # graph.rows [n_features + n_logits, n], columns = sources
    save_graph(graph, "out", decode=tokenizer.decode)   # adjacency.safetensors, nodes.json, graph.json, graph.html
    intervene(pg, transcoders, ids, [FeatureEdit(1, 5, 42, "ablate")]).top_after   # the new top logits

See docs/circuits.md.
"""

from .annotate import annotate_frontend, decoder_logit_weights, live_mlp_layers
from .attention import AttentionFitError, AttentionSite, find_attention_sites
from .attribute import DEFAULT_MAX_FEATURE_NODES, AttributionGraph, attribute, salient_logits
from .complete import Completeness, check_completeness, completeness, default_tolerance
from .errors import (CircuitError, FeatureIndexError, FrozenNodesNotFoundError, IncompleteGraphError, MemoryBoundError,
                     NoPathError)
from .files import add_head_loadings, frontend_graph, graph_slug, load_head_loadings, node_records, save_graph
from .freeze import FrozenLayerNorm, FrozenNodes, FrozenPattern, LinearisedOp, find_frozen_nodes
from .heads import HeadLoadings, head_loadings, save_head_loadings
from .html import graph_html, node_label
from .intervene import EDIT_KINDS, FeatureEdit, InterventionResult, intervene, intervene_direct, top_logits
from .node_ids import cantor_unpair, parse_node_id
from .paths import check_paths
from .prompts import with_special_first
from .prune import (GraphInfluence, PruneResult, compute_influence, graph_influence, graph_scores, logit_weights,
                    normalize_matrix, prune_graph)
from .qk import QKAttribution, QKCheck, QKTerm, check_qk_term, pattern_row, qk_attributions, source_label
from .replacement import ReplacementModel, ReplacementRun, SplicedLayer
from .select import feature_rounds
from .transcoders import LLAMA_MLP_INPUT, LLAMA_MLP_OUTPUT, load_transcoders

__all__ = [
    "AttentionFitError",
    "AttentionSite",
    "HeadLoadings",
    "QKAttribution",
    "QKCheck",
    "QKTerm",
    "check_qk_term",
    "find_attention_sites",
    "head_loadings",
    "add_head_loadings",
    "load_head_loadings",
    "pattern_row",
    "qk_attributions",
    "save_head_loadings",
    "source_label",
    "AttributionGraph",
    "CircuitError",
    "DEFAULT_MAX_FEATURE_NODES",
    "Completeness",
    "EDIT_KINDS",
    "FeatureEdit",
    "FeatureIndexError",
    "FrozenLayerNorm",
    "FrozenNodes",
    "FrozenNodesNotFoundError",
    "FrozenPattern",
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
    "annotate_frontend",
    "attribute",
    "cantor_unpair",
    "check_completeness",
    "check_paths",
    "completeness",
    "compute_influence",
    "decoder_logit_weights",
    "default_tolerance",
    "feature_rounds",
    "find_frozen_nodes",
    "frontend_graph",
    "graph_html",
    "graph_influence",
    "graph_scores",
    "graph_slug",
    "intervene",
    "intervene_direct",
    "live_mlp_layers",
    "load_transcoders",
    "logit_weights",
    "node_label",
    "node_records",
    "normalize_matrix",
    "parse_node_id",
    "prune_graph",
    "salient_logits",
    "save_graph",
    "top_logits",
    "with_special_first",
]
