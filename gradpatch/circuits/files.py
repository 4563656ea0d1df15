"""An attribution graph on disk: the unpruned result (``adjacency.safetensors`` + ``nodes.json``) and the pruned
graph in circuit-tracer's frontend format (``graph.json``), each written atomically.

- ``adjacency.safetensors``: the adjacency's target rows ``rows`` ``[n_features + n_logits, n]`` (columns = sources;
  the error and token rows, zero, are not written), their node indices ``row_nodes`` ``[n_features + n_logits]``
  and ``activations`` ``[n_features]``;
- ``nodes.json``: ``{"nodes": [{"index", "kind", "layer", "position", "feature", "node_path"}, ...]}``, kind one of
  ``feature``, ``error``, ``token``, ``logit`` (a token's ``feature`` is its token id, a logit's its vocabulary id);
- ``graph.json``: circuit-tracer's ``create_graph_files`` model (``metadata``, ``qParams``, ``nodes``, ``links``), which
  Neuronpedia's graph schema accepts: node ids as circuit-tracer writes them (:mod:`~gradpatch.circuits.node_ids`:
  ``{layer}_{feature}_{pos}``, errors ``{layer}_-1_{pos}``, ``E_{token}_{pos}``, ``{n_layers + 1}_{token}_{pos}``),
  each read back to its (layer, position, feature) by circuit-tracer's ``decode_url_features``; a feature node's
  ``feature`` is the Cantor pairing of (layer, feature) under ``metadata.schema_version`` 1 (circuit-tracer 0.5.0's
  encoding); ``metadata.slug`` unique per graph (:func:`graph_slug`) and ``metadata.scan`` the model (Neuronpedia's
  model id); links ``{source, target, weight}`` of the kept edges; no NaN or ±inf anywhere (refused); with head
  loadings, the links whose edge was split also carry ``head_loadings`` (:func:`add_head_loadings`);
- ``head_loadings.safetensors`` / ``.json``: the full sparse table of the head loadings, when given
  (:func:`~gradpatch.circuits.heads.save_head_loadings`; read back by :func:`load_head_loadings`);
- ``graph.html``: ``graph.json`` drawn as one self-contained page (:func:`~gradpatch.circuits.html.graph_html`).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import math
import re
from collections.abc import Callable
from importlib import metadata as package_metadata
from pathlib import Path
from typing import Any

from safetensors import SafetensorError
from safetensors.torch import load_file
from safetensors.torch import save as save_safetensors

from ..files.atomic import atomic_write_bytes, atomic_write_text
from .attribute import AttributionGraph
from .errors import CircuitError
from .heads import HeadLoadings, save_head_loadings
from .html import graph_html
from .node_ids import cantor_pair, error_id, feature_id, logit_id, token_id
from .prune import GraphInfluence, prune_graph

__all__ = ["GRAPH_SCHEMA_VERSION", "HEAD_LOADINGS_DEFINITION", "add_head_loadings", "frontend_graph", "graph_node_ids",
           "graph_slug", "load_head_loadings", "node_records", "save_graph"]

#: ``metadata.schema_version`` of the graph.json written: 1, features as Cantor pairs (circuit-tracer 0.5.0).
GRAPH_SCHEMA_VERSION = 1
#: ``metadata.head_loadings.definition`` of a graph.json with head loadings (:func:`add_head_loadings`).
HEAD_LOADINGS_DEFINITION = ("per attention layer L: total = bypass + sum(per_head), the link's weight up to rounding; "
                            "attention layers not listed carry none of the link through their heads "
                            "(docs/attention.md, head loadings)")
#: What Neuronpedia's upload accepts as a slug or a scan (its ``save-to-db`` route).
_NAME = re.compile(r"[a-zA-Z0-9_.-]+")


def graph_slug(scan: str, prompt: str, created: datetime.datetime | None = None) -> str:
    """A slug for the graph of ``prompt`` on ``scan`` made at ``created``: ``{scan}-{UTC time}-{8 hex digits of the
    SHA-256 of scan, prompt and time}``, in Neuronpedia's ``[a-zA-Z0-9_.-]`` (other characters become ``-``), so
    that a second graph uploaded does not replace the first (Neuronpedia keys graphs by (scan, slug)).

    Args:
        scan: the model's name.
        prompt: the prompt's text.
        created: when (default: now, UTC).
    """
    created = created or datetime.datetime.now(datetime.timezone.utc)
    stamp = created.astimezone(datetime.timezone.utc)
    digest = hashlib.sha256("\0".join([scan, prompt, stamp.isoformat()]).encode()).hexdigest()[:8]
    name = re.sub(r"[^a-zA-Z0-9_.-]+", "-", scan).strip("-.")[:40] or "graph"
    return f"{name}-{stamp:%Y%m%d-%H%M%S}-{digest}"


def _check_finite(frontend: dict[str, Any]) -> None:
    """Raise :class:`CircuitError` naming the nodes and links whose numbers are NaN or ±inf (JSON has neither)."""
    bad = [f"node {node['node_id']} {key}" for node in frontend["nodes"]
           for key in ("influence", "activation", "token_prob")
           if isinstance(node.get(key), float) and not math.isfinite(node[key])]
    bad += [f"link {link['source']} -> {link['target']}" for link in frontend["links"]
            if not math.isfinite(link["weight"])]
    if bad:
        raise CircuitError(f"graph.json cannot hold NaN or ±inf, but {len(bad)} values are ({', '.join(bad[:5])}"
                           f"{', ...' if len(bad) > 5 else ''}): the graph's rows or activations hold them; check the "
                           f"transcoders for NaN (a diverged training) and attribute in float32")


def node_records(graph: AttributionGraph) -> list[dict[str, Any]]:
    """One record per node, in the adjacency's order (module docstring); ``node_path`` is ``None`` for every node of a
    graph whose ``nodes`` is empty (one built by hand).

    Raises:
        CircuitError: ``graph.rows`` is not ``[n_features + n_logits, n]`` for the n nodes that ``active_features``,
            ``layers``, ``input_tokens`` and ``logit_tokens`` give, or ``graph.nodes`` is neither empty nor one
            NodePath per node.
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
    n_targets = graph.n_features + len(graph.logit_tokens)
    if tuple(graph.rows.shape) != (n_targets, n):
        raise CircuitError(f"the rows are {tuple(graph.rows.shape)}, but the graph has {n} nodes "
                           f"({graph.n_features} features, {len(graph.layers)}×{graph.n_pos} errors, {graph.n_pos} "
                           f"tokens, {len(graph.logit_tokens)} logits); set rows to [{n_targets}, {n}]: the features' "
                           f"and logits' rows, columns in that order")
    if graph.nodes and len(graph.nodes) != n:
        raise CircuitError(f"graph.nodes holds {len(graph.nodes)} NodePaths for {n} nodes; set one per node, in the "
                           f"adjacency's order, or leave it empty")
    paths = graph.nodes or [None] * n
    return [{"index": i, **record, "node_path": path} for i, (record, path) in enumerate(zip(records, paths))]


def graph_node_ids(graph: AttributionGraph) -> list[str]:
    """The ``graph.json`` id of every node of ``graph``, in the adjacency's order (:mod:`~gradpatch.circuits.node_ids`).

    Raises:
        CircuitError: as :func:`node_records`.
    """
    n_layers = max(graph.layers) + 1
    ids = []
    for record in node_records(graph):
        kind, layer, position, feature = record["kind"], record["layer"], record["position"], record["feature"]
        if kind == "feature":
            ids.append(feature_id(layer, feature, position))
        elif kind == "error":
            ids.append(error_id(layer, position))
        elif kind == "token":
            ids.append(token_id(feature, position))
        else:
            ids.append(logit_id(n_layers, feature, position))
    return ids


def frontend_graph(graph: AttributionGraph, decode: Callable[[int], str] = str, slug: str | None = None,
                   prompt: str = "", node_threshold: float = 0.8, edge_threshold: float = 0.98,
                   unpruned: GraphInfluence | None = None, scan: str = "gradpatch",
                   created: datetime.datetime | None = None) -> dict[str, Any]:
    """The pruned graph as circuit-tracer's frontend and Neuronpedia read it (module docstring).

    Args:
        decode: token id -> text (a tokenizer's ``decode``; default: the id).
        slug: the graph's name, in ``[a-zA-Z0-9_.-]``; default: :func:`graph_slug` of ``scan``, ``prompt`` and
            ``created``, unique per graph.
        prompt: the prompt's text.
        node_threshold, edge_threshold: pruning (:func:`~gradpatch.circuits.prune.prune_graph`).
        unpruned: ``graph``'s :func:`~gradpatch.circuits.prune.graph_influence`, if already computed.
        scan: the model's name (Neuronpedia's model id, e.g. ``gemma-2-2b``), in ``[a-zA-Z0-9_.-]``.
        created: when the graph was made (default: now), recorded in ``metadata.info.create_time_ms``.

    Raises:
        CircuitError: a ``slug`` or ``scan`` with other characters, a threshold outside [0, 1], or a NaN or ±inf
            in a kept node's influence or activation or a kept edge's weight (JSON has none; the message names them).
    """
    created = created or datetime.datetime.now(datetime.timezone.utc)
    slug = graph_slug(scan, prompt, created) if slug is None else slug
    for name, value in (("slug", slug), ("scan", scan)):
        if not _NAME.fullmatch(value):
            raise CircuitError(f"{name} {value!r} has characters Neuronpedia refuses; give one of letters, digits, "
                               f"'_', '.' and '-'")
    pruned = prune_graph(graph, node_threshold, edge_threshold, unpruned)
    n_layers = max(graph.layers) + 1
    records = node_records(graph)
    ids = graph_node_ids(graph)
    nodes: dict[int, dict[str, Any]] = {}
    kept = pruned.node_mask.nonzero().flatten().tolist()
    for index in kept:
        record, influence = records[index], float(pruned.cumulative_scores[index])
        kind, layer, position, feature = record["kind"], record["layer"], record["position"], record["feature"]
        if kind == "feature":
            node = {"node_id": ids[index], "feature": cantor_pair(layer, feature),
                    "layer": str(layer), "feature_type": "cross layer transcoder", "jsNodeId": f"{layer}_{feature}-0",
                    "influence": influence, "activation": float(graph.activations[index])}
        elif kind == "error":
            node = {"node_id": ids[index], "feature": -1, "layer": str(layer),
                    "feature_type": "mlp reconstruction error", "jsNodeId": f"{layer}_-1-{position}",
                    "influence": influence}
        elif kind == "token":
            node = {"node_id": ids[index], "feature": position, "layer": "E",
                    "feature_type": "embedding", "jsNodeId": f"E_{feature}-{position}", "influence": influence}
        else:
            probability = float(graph.logit_probabilities[index - graph.logit_start])
            node = {"node_id": ids[index], "feature": feature, "layer": str(n_layers + 1),
                    "feature_type": "logit", "token_prob": probability,
                    "is_target_logit": index == graph.logit_start, "jsNodeId": f"L_{feature}-{position}",
                    "clerp": f'Output "{decode(feature)}" (p={probability:.3f})'}
        nodes[index] = {"ctx_idx": position, "token_prob": 0.0, "is_target_logit": False, "run_idx": 0,
                        "reverse_ctx_idx": 0, "clerp": "", "influence": None, "activation": None, **node}
    rows, sources = pruned.edge_mask.nonzero(as_tuple=True)  # edge_mask's rows are the graph's target rows
    target_nodes = graph.target_nodes.tolist()
    links = [{"source": nodes[s]["node_id"], "target": nodes[target_nodes[r]]["node_id"],
              "weight": float(graph.rows[r, s])}
             for r, s in zip(rows.tolist(), sources.tolist()) if s in nodes and target_nodes[r] in nodes]
    linked = {link["source"] for link in links} | {link["target"] for link in links}
    used = [node for node in nodes.values()
            if node["node_id"] in linked or node["feature_type"] in ("embedding", "logit")]
    info = {"generator": {"name": "gradpatch", "version": _version()},
            "create_time_ms": int(created.timestamp() * 1000)}
    metadata = {"slug": slug, "scan": scan, "transcoder_list": [], "node_threshold": node_threshold, "prompt": prompt,
                "prompt_tokens": [decode(token) for token in graph.input_tokens.tolist()],
                "schema_version": GRAPH_SCHEMA_VERSION, "info": info,
                "pruning_settings": {"node_threshold": node_threshold, "edge_threshold": edge_threshold}}
    query = {"pinnedIds": [], "supernodes": [], "linkType": "both", "clickedId": "", "sg_pos": ""}
    frontend = {"metadata": metadata, "qParams": query, "nodes": used, "links": links}
    _check_finite(frontend)
    return frontend


def add_head_loadings(frontend: dict[str, Any], graph: AttributionGraph, loadings: HeadLoadings) -> dict[str, Any]:
    """``frontend`` (``graph``'s ``graph.json``) with the head loadings of its links that ``loadings`` split (a new
    dict; ``frontend`` is not changed).

    Each such link gets ``"head_loadings": {"total", "layers": [{"attention_layer", "bypass", "per_head"}, ...]}``
    (the names of circuit-tracer PR 114's ``PathHeadLoadings`` / ``HeadLoadings``): ``total`` the edge as the split
    computed it (the link's ``weight`` up to rounding), per attention layer L (ascending) ``bypass`` = bypass_L and
    ``per_head`` = [loading_L,h for every head h], so that ``bypass + sum(per_head) = total``; a layer whose heads
    all carry exactly nothing is left out (its bypass is the whole edge). ``metadata.head_loadings`` records
    ``{"heads": heads per attention layer, "links": links with loadings, "definition"}``. Links whose edge was not
    split get nothing; edges split but pruned away are only in ``head_loadings.safetensors``
    (:func:`~gradpatch.circuits.heads.save_head_loadings`). Neuronpedia's graph schema (its link objects allow
    further keys) and circuit-tracer's frontend (links are plain dicts) accept the extra keys.

    Args:
        frontend: :func:`frontend_graph`'s dict (or an annotated one).
        graph: the graph it was made from (node indices -> ids).
        loadings: :func:`~gradpatch.circuits.heads.head_loadings` of ``graph``.

    Returns:
        The dict with the loadings.

    Raises:
        CircuitError: ``loadings`` name nodes ``graph`` does not have (loadings of another graph), or hold NaN or
            ±inf (JSON has neither).
    """
    ids = graph_node_ids(graph)
    if loadings.edges.numel() and int(loadings.edges[:, :2].max()) >= len(ids):
        raise CircuitError(f"the head loadings name node {int(loadings.edges[:, :2].max())}, but the graph has "
                           f"{len(ids)} nodes: give the loadings computed on this graph")
    totals = {(ids[int(t)], ids[int(s)]): (int(t), int(s), total) for t, s, total in loadings.edges.tolist()}
    annotated = dict(frontend, metadata=dict(frontend["metadata"]), links=[dict(link) for link in frontend["links"]])
    count = 0
    for link in annotated["links"]:
        found = totals.get((link["target"], link["source"]))
        if found is None:
            continue
        target, source, total = found
        split = sorted(loadings.edge(target, source).items())
        layers = [{"attention_layer": layer, "bypass": bypass, "per_head": per_head.tolist()}
                  for layer, (per_head, bypass) in split if bool(per_head.any())]
        numbers = [total] + [v for layer in layers for v in (layer["bypass"], *layer["per_head"])]
        if not all(math.isfinite(v) for v in numbers):
            raise CircuitError(f"the head loadings of link {link['source']} -> {link['target']} hold NaN or ±inf, "
                               f"which JSON cannot hold: compute them in float32 or float64 on finite transcoders")
        link["head_loadings"] = {"total": total, "layers": layers}
        count += 1
    annotated["metadata"]["head_loadings"] = {"heads": list(loadings.heads), "links": count,
                                              "definition": HEAD_LOADINGS_DEFINITION}
    return annotated


def load_head_loadings(directory: str | Path) -> HeadLoadings:
    """The head loadings that :func:`~gradpatch.circuits.heads.save_head_loadings` wrote into ``directory``
    (``head_loadings.safetensors``: ``indices`` ``[n, 4]``, ``values`` ``[n]``, ``edges`` ``[n_edges, 3]``,
    ``heads``).

    Raises:
        CircuitError: the file is missing, unreadable or lacks one of those tensors.
    """
    path = Path(directory) / "head_loadings.safetensors"
    try:
        tensors = load_file(str(path))
    except (OSError, SafetensorError) as error:
        raise CircuitError(f"cannot read {path} ({error}); write it with save_head_loadings (gradpatch circuit "
                           f"--head-loadings)") from error
    missing = sorted({"indices", "values", "edges", "heads"} - set(tensors))
    if missing:
        raise CircuitError(f"{path} lacks {', '.join(missing)}; write it with save_head_loadings")
    return HeadLoadings(tensors["indices"], tensors["values"], tensors["edges"], tensors["heads"].tolist())


def _version() -> str:
    try:
        return package_metadata.version("gradpatch")
    except package_metadata.PackageNotFoundError:
        return "unknown"


def save_graph(graph: AttributionGraph, directory: str | Path, decode: Callable[[int], str] = str,
               slug: str | None = None, prompt: str = "", node_threshold: float = 0.8,
               edge_threshold: float = 0.98, unpruned: GraphInfluence | None = None,
               scan: str = "gradpatch", annotate: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
               head_loadings: HeadLoadings | None = None) -> Path:
    """Write ``adjacency.safetensors``, ``nodes.json``, ``graph.json`` and ``graph.html`` to ``directory`` (created if
    missing), each atomically. ``slug``, ``scan`` and the other arguments: as :func:`frontend_graph`; ``annotate``:
    applied to the frontend dict before it is written, e.g. ``functools.partial(annotate_frontend, graph=graph,
    replacement=replacement, decode=decode)`` (:func:`~gradpatch.circuits.annotate.annotate_frontend`: scores, each
    feature's top logits and snippets, which graph.html shows); ``head_loadings``: ``graph``'s
    :func:`~gradpatch.circuits.heads.head_loadings`, written beside the adjacency (``head_loadings.safetensors`` and
    ``.json``, :func:`~gradpatch.circuits.heads.save_head_loadings`) and onto graph.json's links
    (:func:`add_head_loadings`), which graph.html shows for a selected link.

    Returns:
        The directory as a ``Path``.

    Raises:
        CircuitError: as :func:`frontend_graph` and :func:`add_head_loadings` (checked before anything is written).
    """
    directory = Path(directory)
    frontend = frontend_graph(graph, decode, slug, prompt, node_threshold, edge_threshold, unpruned, scan)
    if annotate is not None:
        frontend = annotate(frontend)
    if head_loadings is not None:
        frontend = add_head_loadings(frontend, graph, head_loadings)
    page = graph_html(frontend)
    tensors = {"rows": graph.rows.contiguous(), "row_nodes": graph.target_nodes,
               "activations": graph.activations.contiguous()}
    atomic_write_bytes(directory / "adjacency.safetensors", save_safetensors(tensors))
    atomic_write_text(directory / "nodes.json", json.dumps({"nodes": node_records(graph)}, indent=1, allow_nan=False))
    atomic_write_text(directory / "graph.json", json.dumps(frontend, indent=1, allow_nan=False))
    atomic_write_text(directory / "graph.html", page)
    if head_loadings is not None:
        save_head_loadings(head_loadings, directory)
    return directory
