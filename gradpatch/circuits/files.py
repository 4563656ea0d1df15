"""An attribution graph on disk: the unpruned result (``adjacency.safetensors`` + ``nodes.json``) and the pruned
graph in circuit-tracer's frontend format (``graph.json``), each written atomically.

- ``adjacency.safetensors``: ``adjacency`` ``[n, n]`` (rows = targets, columns = sources) and ``activations``
  ``[n_features]``;
- ``nodes.json``: ``{"nodes": [{"index", "kind", "layer", "position", "feature", "node_path"}, ...]}``, kind one of
  ``feature``, ``error``, ``token``, ``logit`` (a token's ``feature`` is its token id, a logit's its vocabulary id);
- ``graph.json``: circuit-tracer's ``create_graph_files`` model (``metadata``, ``qParams``, ``nodes``, ``links``):
  node ids ``{layer}_{feature}_{pos}`` (features), ``0_{layer}_{pos}`` (errors), ``E_{token}_{pos}`` (tokens),
  ``{n_layers + 1}_{token}_{pos}`` (logits), except that an error node whose id a kept layer-0 feature already has
  (feature ℓ at position p and the error of layer ℓ at p are both ``0_{ℓ}_{p}`` in circuit-tracer's scheme) is
  ``0_{ℓ}_{p}_error``, so that every id, and every link, names one node; links ``{source, target, weight}`` of the
  kept edges;
- ``graph.html``: ``graph.json`` drawn as one self-contained page (:func:`~gradpatch.circuits.html.graph_html`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from safetensors.torch import save as save_safetensors

from ..files.atomic import atomic_write_bytes, atomic_write_text
from .attribute import AttributionGraph
from .errors import CircuitError
from .html import graph_html
from .prune import GraphInfluence, prune_graph

__all__ = ["frontend_graph", "node_records", "save_graph"]


def node_records(graph: AttributionGraph) -> list[dict[str, Any]]:
    """One record per node, in the adjacency's order (module docstring); ``node_path`` is ``None`` for every node of a
    graph whose ``nodes`` is empty (one built by hand).

    Raises:
        CircuitError: ``graph.adjacency`` is not ``[n, n]`` for the n nodes that ``active_features``, ``layers``,
            ``input_tokens`` and ``logit_tokens`` give, or ``graph.nodes`` is neither empty nor one NodePath per node.
    """
    records: list[dict[str, Any]] = []
    for layer, position, feature in graph.active_features.tolist():
        records.append({"kind": "feature", "layer": layer, "position": position, "feature": feature})
    for layer in graph.layers:
        records.extend({"kind": "error", "layer": layer, "position": p, "feature": None} for p in range(graph.n_pos))
    for position, token in enumerate(graph.input_tokens.tolist()):
        records.append({"kind": "token", "layer": None, "position": position, "feature": token})
    for token in graph.logit_tokens.tolist():
        records.append({"kind": "logit", "layer": None, "position": graph.n_pos - 1, "feature": token})
    n = len(records)
    if tuple(graph.adjacency.shape) != (n, n):
        raise CircuitError(f"the adjacency is {tuple(graph.adjacency.shape)}, but the graph has {n} nodes "
                           f"({graph.n_features} features, {len(graph.layers)}×{graph.n_pos} errors, {graph.n_pos} "
                           f"tokens, {len(graph.logit_tokens)} logits); set adjacency to [{n}, {n}] in that order")
    if graph.nodes and len(graph.nodes) != n:
        raise CircuitError(f"graph.nodes holds {len(graph.nodes)} NodePaths for {n} nodes; set one per node, in the "
                           f"adjacency's order, or leave it empty")
    paths = graph.nodes or [None] * n
    return [{"index": i, **record, "node_path": path} for i, (record, path) in enumerate(zip(records, paths))]


def frontend_graph(graph: AttributionGraph, decode: Callable[[int], str] = str, slug: str = "gradpatch",
                   prompt: str = "", node_threshold: float = 0.8, edge_threshold: float = 0.98,
                   unpruned: GraphInfluence | None = None) -> dict[str, Any]:
    """The pruned graph as circuit-tracer's frontend reads it (module docstring).

    Args:
        decode: token id -> text (a tokenizer's ``decode``; default: the id).
        slug: the graph's name; prompt: the prompt's text.
        node_threshold, edge_threshold: pruning (:func:`~gradpatch.circuits.prune.prune_graph`).
        unpruned: ``graph``'s :func:`~gradpatch.circuits.prune.graph_influence`, if already computed.
    """
    pruned = prune_graph(graph, node_threshold, edge_threshold, unpruned)
    n_layers = max(graph.layers) + 1
    records = node_records(graph)
    nodes: dict[int, dict[str, Any]] = {}
    kept = pruned.node_mask.nonzero().flatten().tolist()
    features = {f"{records[i]['layer']}_{records[i]['feature']}_{records[i]['position']}" for i in kept
                if records[i]["kind"] == "feature"}
    for index in kept:
        record, influence = records[index], float(pruned.cumulative_scores[index])
        kind, layer, position, feature = record["kind"], record["layer"], record["position"], record["feature"]
        if kind == "feature":
            node = {"node_id": f"{layer}_{feature}_{position}", "feature": feature, "layer": str(layer),
                    "feature_type": "cross layer transcoder", "jsNodeId": f"{layer}_{feature}-0",
                    "influence": influence, "activation": float(graph.activations[index])}
        elif kind == "error":  # circuit-tracer's 0_{layer}_{pos} is also layer-0 feature {layer}'s id at pos
            suffix = "_error" if f"0_{layer}_{position}" in features else ""
            node = {"node_id": f"0_{layer}_{position}{suffix}", "feature": -1, "layer": str(layer),
                    "feature_type": "mlp reconstruction error", "jsNodeId": f"{layer}_{position}-0",
                    "influence": influence}
        elif kind == "token":
            node = {"node_id": f"E_{feature}_{position}", "feature": position, "layer": "E",
                    "feature_type": "embedding", "jsNodeId": f"E_{feature}-{position}", "influence": influence}
        else:
            probability = float(graph.logit_probabilities[index - graph.logit_start])
            node = {"node_id": f"{n_layers + 1}_{feature}_{position}", "feature": feature, "layer": str(n_layers + 1),
                    "feature_type": "logit", "token_prob": probability,
                    "is_target_logit": index == graph.logit_start, "jsNodeId": f"L_{feature}-{position}",
                    "clerp": f'Output "{decode(feature)}" (p={probability:.3f})'}
        nodes[index] = {"ctx_idx": position, "token_prob": 0.0, "is_target_logit": False, "run_idx": 0,
                        "reverse_ctx_idx": 0, "clerp": "", "influence": None, "activation": None, **node}
    targets, sources = pruned.edge_mask.nonzero(as_tuple=True)
    links = [{"source": nodes[s]["node_id"], "target": nodes[t]["node_id"], "weight": float(graph.adjacency[t, s])}
             for t, s in zip(targets.tolist(), sources.tolist()) if s in nodes and t in nodes]
    linked = {link["source"] for link in links} | {link["target"] for link in links}
    used = [node for node in nodes.values()
            if node["node_id"] in linked or node["feature_type"] in ("embedding", "logit")]
    metadata = {"slug": slug, "scan": slug, "transcoder_list": [], "node_threshold": node_threshold, "prompt": prompt,
                "prompt_tokens": [decode(token) for token in graph.input_tokens.tolist()]}
    query = {"pinnedIds": [], "supernodes": [], "linkType": "both", "clickedId": "", "sg_pos": ""}
    return {"metadata": metadata, "qParams": query, "nodes": used, "links": links}


def save_graph(graph: AttributionGraph, directory: str | Path, decode: Callable[[int], str] = str,
               slug: str = "gradpatch", prompt: str = "", node_threshold: float = 0.8,
               edge_threshold: float = 0.98, unpruned: GraphInfluence | None = None) -> Path:
    """Write ``adjacency.safetensors``, ``nodes.json``, ``graph.json`` and ``graph.html`` to ``directory`` (created if
    missing), each atomically. ``unpruned``: ``graph``'s :func:`~gradpatch.circuits.prune.graph_influence`, if
    already computed.

    Returns:
        The directory as a ``Path``.
    """
    directory = Path(directory)
    tensors = {"adjacency": graph.adjacency.contiguous(), "activations": graph.activations.contiguous()}
    atomic_write_bytes(directory / "adjacency.safetensors", save_safetensors(tensors))
    atomic_write_text(directory / "nodes.json", json.dumps({"nodes": node_records(graph)}, indent=1))
    frontend = frontend_graph(graph, decode, slug, prompt, node_threshold, edge_threshold, unpruned)
    atomic_write_text(directory / "graph.json", json.dumps(frontend, indent=1))
    atomic_write_text(directory / "graph.html", graph_html(frontend))
    return directory
