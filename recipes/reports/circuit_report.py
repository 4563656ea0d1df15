"""What ``gradpatch circuit`` writes: the attribution graph's files (:func:`gradpatch.circuits.save_graph`), the
interventions' top logits and a TensorBoard run, all published at once (nothing appears in the output folder unless
every file was written)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from gradpatch.circuits import (AttributionGraph, FeatureEdit, GraphInfluence, InterventionResult, graph_scores,
                                node_label, save_graph)
from gradpatch.files.atomic import atomic_write_text

from .attribution_report import publish_dir, staging_dir

__all__ = ["intervention_record", "save_circuit"]


def intervention_record(result: InterventionResult, edits: Sequence[FeatureEdit],
                        decode: Callable[[int], str]) -> dict[str, Any]:
    """The JSON of an intervention: the edits (with each feature's activation before its edit) and the top logits
    at the last position before and after."""
    def top(pairs: list[tuple[int, float]]) -> list[dict[str, Any]]:
        return [{"token": token, "text": decode(token), "probability": p} for token, p in pairs]
    return {"edits": [{"kind": e.kind, "layer": e.layer, "position": e.position, "feature": e.feature,
                       "value": e.value, "activation": a} for e, a in zip(edits, result.activations)],
            "top_before": top(result.top_before), "top_after": top(result.top_after)}


def _influence_figure(graph: AttributionGraph, unpruned: GraphInfluence, tokens: list[str]) -> Any:
    """Heatmap ``[layers, positions]`` of the feature nodes' summed influence on the logits."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    influence = unpruned.influence[:graph.n_features]
    rows = {layer: i for i, layer in enumerate(graph.layers)}
    grid = torch.zeros(len(graph.layers), graph.n_pos)
    for (layer, position, _), value in zip(graph.active_features.tolist(), influence.tolist()):
        grid[rows[layer], position] += value
    fig, ax = plt.subplots(figsize=(max(4.0, 0.6 * graph.n_pos + 2), max(3.0, 0.25 * len(graph.layers) + 2)))
    image = ax.imshow(grid.numpy(), aspect="auto", origin="lower", cmap="viridis")
    ax.set_xticks(range(graph.n_pos), tokens, rotation=90, fontsize=7)
    ax.set_yticks(range(len(graph.layers)), [str(layer) for layer in graph.layers], fontsize=7)
    ax.set_xlabel("position")
    ax.set_ylabel("layer")
    ax.set_title("feature influence on the logits", fontsize=9)
    fig.colorbar(image, ax=ax)
    fig.tight_layout()
    return fig


def _table(header: str, rows: list[str]) -> str:
    columns = header.count("|") - 1
    return "\n".join([header, "|" + "---|" * columns, *rows])


def _tensorboard(logdir: Path, graph: AttributionGraph, unpruned: GraphInfluence, frontend: dict[str, Any],
                 intervention: dict[str, Any] | None) -> None:
    from torch.utils.tensorboard import SummaryWriter

    tokens = frontend["metadata"]["prompt_tokens"]
    labels = {node["node_id"]: node_label(node, tokens) for node in frontend["nodes"]}
    replacement, completeness = graph_scores(graph, unpruned)
    writer = SummaryWriter(log_dir=str(logdir))
    try:
        writer.add_scalar("circuit/replacement_score", replacement)
        writer.add_scalar("circuit/completeness_score", completeness)
        writer.add_scalar("circuit/pruned_nodes", len(frontend["nodes"]))
        writer.add_scalar("circuit/pruned_edges", len(frontend["links"]))
        summary = {"prompt": frontend["metadata"]["prompt"], "features": graph.n_features,
                   "nodes": graph.n_nodes, "pruned_nodes": len(frontend["nodes"]),
                   "pruned_edges": len(frontend["links"]), "replacement_score": replacement,
                   "completeness_score": completeness}
        writer.add_text("circuit/summary", "```\n" + json.dumps(summary, indent=1) + "\n```")
        nodes = sorted(frontend["nodes"], key=lambda node: node["influence"] if node["influence"] is not None else 2)
        writer.add_text("circuit/top_nodes", _table("| node | activation | cumulative influence |", [
            f"| {labels[n['node_id']]} | {n['activation'] or ''} | {n['influence']} |" for n in nodes[:30]]))
        links = sorted(frontend["links"], key=lambda link: -abs(link["weight"]))
        writer.add_text("circuit/top_edges", _table("| source | target | weight |", [
            f"| {labels[k['source']]} | {labels[k['target']]} | {k['weight']:.4g} |" for k in links[:30]]))
        writer.add_figure("circuit/feature_influence", _influence_figure(graph, unpruned, tokens), close=True)
        if intervention is not None:
            writer.add_text("circuit/intervention", "```\n" + json.dumps(intervention, indent=1) + "\n```")
    finally:
        writer.close()


def save_circuit(graph: AttributionGraph, out: str | Path, *, decode: Callable[[int], str], prompt: str,
                 slug: str | None, node_threshold: float, edge_threshold: float, unpruned: GraphInfluence,
                 intervention: dict[str, Any] | None = None, scan: str = "gradpatch",
                 annotate: Callable[[dict[str, Any]], dict[str, Any]] | None = None) -> list[Path]:
    """Write ``adjacency.safetensors``, ``nodes.json``, ``graph.json``, ``graph.html``, ``interventions.json`` (when
    ``intervention`` is given, :func:`intervention_record`) and ``tensorboard/`` into ``out``, all at once.
    ``unpruned``: ``graph``'s :func:`gradpatch.circuits.graph_influence` (pruning, the scores and the figure start
    from it); ``slug`` (``None``: unique per graph, :func:`gradpatch.circuits.graph_slug`) and ``scan`` (the model's
    name): ``graph.json``'s, as :func:`gradpatch.circuits.save_graph` takes them; ``annotate``: applied to graph.json
    before it is written (:func:`gradpatch.circuits.save_graph`'s).

    Returns:
        The paths written (in ``out``).

    Raises:
        CircuitError: a threshold outside [0, 1] (nothing written).
    """
    out = Path(out)
    staging = staging_dir(out)
    try:
        save_graph(graph, staging, decode=decode, slug=slug, prompt=prompt, node_threshold=node_threshold,
                   edge_threshold=edge_threshold, unpruned=unpruned, scan=scan,
                   annotate=annotate)
        frontend = json.loads((staging / "graph.json").read_text(encoding="utf-8"))
        if intervention is not None:
            atomic_write_text(staging / "interventions.json", json.dumps(intervention, indent=1))
        _tensorboard(staging / "tensorboard", graph, unpruned, frontend, intervention)
        names = sorted(entry.name for entry in staging.iterdir())
    except BaseException:
        shutil.rmtree(staging)
        raise
    publish_dir(staging, out)
    return [out / name for name in names]
