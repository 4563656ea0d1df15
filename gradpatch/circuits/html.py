"""``graph.html``: a pruned attribution graph as one self-contained page (inline SVG, CSS and script; no server, no
network, nothing fetched), to look at without installing circuit-tracer's frontend.

The page draws the nodes of ``graph.json`` (circuit-tracer's frontend format, :func:`~gradpatch.circuits.files.
frontend_graph`) on a grid: one column per prompt position, one row per layer that has a node, the token embeddings
at the bottom and the logits at the top; its links are lines, blue for positive and red for negative weights, wider
for larger |weight|.
Every node carries its label (:func:`node_label`: layer, feature, position and token) as a tooltip and in the table
below the drawing, which also gives its activation and influence. Clicking a node highlights its links.
"""

from __future__ import annotations

import html
import json
from collections import defaultdict
from typing import Any

__all__ = ["graph_html", "node_label"]

_CELL_W, _NODE_STEP, _ROW_GAP, _MARGIN = 110, 14, 26, 70
_STYLE = """body{font-family:sans-serif;margin:16px;color:#222}svg{border:1px solid #ccc;background:#fff}
line{stroke-opacity:.35}line.pos{stroke:#2060c0}line.neg{stroke:#c03020}line.hi{stroke-opacity:1}
circle{stroke:#333;stroke-width:.8}circle.feature{fill:#f0c040}circle.error{fill:#aaa}
circle.embedding{fill:#70b070}circle.logit{fill:#a070d0}circle.sel{stroke:#000;stroke-width:2.5}
table{border-collapse:collapse;font-size:12px;margin-top:12px}td,th{border:1px solid #ddd;padding:2px 6px}
text{font-size:11px}tr.sel{background:#ffe9a0}"""
_SCRIPT = """function pick(id){document.querySelectorAll('.sel').forEach(e=>e.classList.remove('sel'));
document.querySelectorAll('line').forEach(l=>l.classList.toggle('hi',l.dataset.source===id||l.dataset.target===id));
document.querySelectorAll('[data-node="'+id+'"]').forEach(e=>e.classList.add('sel'));}
document.querySelectorAll('[data-node]').forEach(e=>e.addEventListener('click',()=>pick(e.dataset.node)));"""


def _token(tokens: list[str], position: int) -> str:
    return json.dumps(tokens[position], ensure_ascii=False) if 0 <= position < len(tokens) else "?"


def node_label(node: dict[str, Any], prompt_tokens: list[str]) -> str:
    """The text that names a ``graph.json`` node: ``L{layer} F{feature} @{position} "{token}"`` for a feature,
    ``error L{layer} @{position} "{token}"``, ``embedding @{position} "{token}"``, or the logit's ``clerp``
    (``Output "{token}" (p=…)``)."""
    position, kind = int(node["ctx_idx"]), node["feature_type"]
    token = _token(prompt_tokens, position)
    if kind == "embedding":
        return f"embedding @{position} {token}"
    if kind == "logit":
        return str(node["clerp"])
    if kind == "mlp reconstruction error":
        return f"error L{node['layer']} @{position} {token}"
    return f"L{node['layer']} F{node['feature']} @{position} {token}"


def _kind(node: dict[str, Any]) -> str:
    return {"embedding": "embedding", "logit": "logit", "mlp reconstruction error": "error"}.get(
        node["feature_type"], "feature")


def _rows(nodes: list[dict[str, Any]]) -> list[str]:
    """The grid's rows from the bottom: ``embeddings``, ``layer ℓ`` for each layer with a feature or error node
    (ascending), ``logits``."""
    layers = sorted({int(n["layer"]) for n in nodes if _kind(n) in ("feature", "error")})
    return ["embeddings", *(f"layer {layer}" for layer in layers), "logits"]


def _row_name(node: dict[str, Any]) -> str:
    kind = _kind(node)
    return {"embedding": "embeddings", "logit": "logits"}.get(kind, f"layer {node['layer']}")


def _positions(nodes: list[dict[str, Any]], n_pos: int) -> tuple[dict[str, tuple[float, float]],
                                                                   list[tuple[str, float]], int, int]:
    """Node id -> (x, y) centre, each grid row's name and lowest y, and the drawing's width and height."""
    names = _rows(nodes)
    index = {name: row for row, name in enumerate(names)}
    cells: dict[tuple[int, int], list[dict[str, Any]]] = defaultdict(list)
    for node in nodes:
        cells[(index[_row_name(node)], int(node["ctx_idx"]))].append(node)
    per_line = max(1, (_CELL_W - 10) // _NODE_STEP)
    lines = [max([-(-len(cells[(row, p)]) // per_line) for p in range(n_pos)] + [1]) for row in range(len(names))]
    heights = [count * _NODE_STEP + _ROW_GAP for count in lines]
    height = sum(heights) + 2 * _MARGIN
    width = n_pos * _CELL_W + 2 * _MARGIN
    bottoms = [height - _MARGIN - sum(heights[:row]) - _ROW_GAP / 2 for row in range(len(names))]
    where: dict[str, tuple[float, float]] = {}
    for (row, position), members in cells.items():
        for i, node in enumerate(sorted(members, key=lambda n: (-abs(n.get("influence") or 0), n["node_id"]))):
            x = _MARGIN + position * _CELL_W + 10 + (i % per_line) * _NODE_STEP
            where[node["node_id"]] = (x, bottoms[row] - (i // per_line) * _NODE_STEP)
    return where, list(zip(names, bottoms)), width, height


def _number(value: Any) -> str:
    return "" if value is None else f"{float(value):.4g}"


def graph_html(frontend: dict[str, Any]) -> str:
    """The page (module docstring) of ``frontend``, a ``graph.json`` document (``metadata``, ``nodes``, ``links``)."""
    metadata, nodes, links = frontend["metadata"], frontend["nodes"], frontend["links"]
    tokens = [str(t) for t in metadata.get("prompt_tokens", [])]
    n_pos = max([len(tokens)] + [int(n["ctx_idx"]) + 1 for n in nodes])
    where, rows, width, height = _positions(nodes, n_pos)
    esc = html.escape
    largest = max([abs(float(link["weight"])) for link in links] + [1e-30])
    parts = [f'<svg width="{width}" height="{height}" viewBox="0 0 {width} {height}" role="img">']
    for position in range(n_pos):
        x = _MARGIN + position * _CELL_W + 4
        parts.append(f'<text x="{x}" y="{height - 12}">{esc(_token(tokens, position))}</text>')
    for name, y in rows:
        parts.append(f'<text x="4" y="{y + 4:.1f}">{name}</text>')
    for link in links:
        (x1, y1), (x2, y2) = where[link["source"]], where[link["target"]]
        weight = float(link["weight"])
        parts.append(f'<line x1="{x1:.1f}" y1="{y1:.1f}" x2="{x2:.1f}" y2="{y2:.1f}" '
                     f'class="{"pos" if weight >= 0 else "neg"}" stroke-width="{0.4 + 3 * abs(weight) / largest:.2f}" '
                     f'data-source="{esc(link["source"])}" data-target="{esc(link["target"])}">'
                     f'<title>{esc(link["source"])} → {esc(link["target"])}: {weight:.4g}</title></line>')
    rows = []
    for node in nodes:
        x, y = where[node["node_id"]]
        label, node_id = esc(node_label(node, tokens)), esc(node["node_id"])
        parts.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="5" class="{_kind(node)}" data-node="{node_id}">'
                     f'<title>{label}</title></circle>')
        rows.append(f'<tr data-node="{node_id}"><td>{label}</td><td>{node_id}</td><td>{_kind(node)}</td>'
                    f'<td>{_number(node.get("activation"))}</td><td>{_number(node.get("influence"))}</td></tr>')
    parts.append("</svg>")
    title = esc(str(metadata.get("slug", "attribution graph")))
    return "\n".join([
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">', f"<title>{title}</title>",
        f"<style>{_STYLE}</style></head><body>",
        f"<h1>{title}</h1><p>Prompt: {esc(str(metadata.get('prompt', '')))}</p>",
        f"<p>{len(nodes)} nodes, {len(links)} links (node threshold {metadata.get('node_threshold')}); rows from "
        "the bottom: embeddings, layers, logits; blue links positive, red negative. Click a node to highlight its "
        "links.</p>",
        *parts,
        "<table><thead><tr><th>node</th><th>id</th><th>kind</th><th>activation</th><th>cumulative influence</th>"
        "</tr></thead><tbody>", *rows, "</tbody></table>",
        f"<script>{_SCRIPT}</script></body></html>", ""])
