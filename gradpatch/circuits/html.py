"""``graph.html``: a pruned attribution graph as one self-contained page (inline SVG, CSS and script; no server, no
network, nothing fetched), to read without installing circuit-tracer's frontend.

The page of ``graph.json`` (circuit-tracer's frontend format, :func:`~gradpatch.circuits.files.frontend_graph`,
with the optional fields of :mod:`gradpatch.circuits.annotate`) shows:

- a header: the prompt, node and link counts, the replacement and completeness scores, the MLP layers that had no
  transcoder (live MLPs), and, when pruning kept no feature node, what that means and which thresholds to raise;
- a legend (node kinds, link colours, grouping marks) and the drawing: one column per prompt position (the tokens
  below), one row per layer with a feature or error node, the embeddings at the bottom; the logits above, each in a
  slot of its own with its token and probability (the token cut to fit the slot, so labels never overlap); links blue
  for positive and red for negative weights, wider for larger |weight|;
- tooltips naming nodes (:func:`node_label`) and links (``source → target: weight``); a click shows a node's
  details (its top logits and top activating snippets where ``graph.json`` has them, its strongest inputs and
  outputs) and highlights its links;
- a selected link (clicked, or picked from a node's inputs and outputs or from the list of links with head
  loadings): its weight and, where ``graph.json`` has them, its head loadings per attention layer
  (:mod:`gradpatch.circuits.html_heads`);
- the node table, sorted by influence (most influential first; re-sortable by any column);
- supernodes as circuit-tracer's frontend keeps them (``qParams.supernodes``: ``[[name, node_id, ...], ...]``):
  shift-click nodes (or tick them in the table), name the group, group; groups are read from ``graph.json``'s
  ``qParams.supernodes`` when the page is built, saved by downloading ``graph.json`` with them (their members added
  to ``qParams.pinnedIds``, which circuit-tracer's subgraph needs), and loaded from such a file.

The scripts (:mod:`gradpatch.circuits.html_script`, :mod:`gradpatch.circuits.html_heads`) read the graph from a
JSON block in the page.
"""

from __future__ import annotations

import html
import json
import math
import re
from collections import defaultdict
from typing import Any

from .html_heads import HEADS_SCRIPT, HEADS_STYLE, head_loadings_section
from .html_script import SCRIPT, STYLE
from .node_ids import parse_node_id

__all__ = ["graph_html", "node_label"]

_CELL_W, _NODE_STEP, _ROW_GAP = 120, 14, 26
_LEFT, _RIGHT, _TOP, _BOTTOM = 70, 20, 8, 40
#: Width of one logit's slot and the height of a line of slots; labels are 11px monospace, at most _CHAR_W px per
#: character, cut to the characters that fit their slot after the circle.
_LOGIT_W, _LOGIT_LINE, _CHAR_W, _LABEL_X = 150, 30, 7.0, 14
_KINDS = {"embedding": "embedding", "logit": "logit", "mlp reconstruction error": "error"}
_CLERP = re.compile(r'Output "(.*)" \(p=[^)]*\)', re.DOTALL)


def _token(tokens: list[str], position: int) -> str:
    return json.dumps(tokens[position], ensure_ascii=False) if 0 <= position < len(tokens) else "?"


def node_label(node: dict[str, Any], prompt_tokens: list[str]) -> str:
    """The text that names a ``graph.json`` node: ``L{layer} F{feature} @{position} "{token}"`` for a feature (its
    index in its transcoder, read from the node id: the ``feature`` field is a Cantor pair), ``error L{layer}
    @{position} "{token}"``, ``embedding @{position} "{token}"``, or the logit's ``clerp`` (``Output "{token}"
    (p=…)``).

    Raises:
        CircuitError: a feature node whose id is not ``{layer}_{feature}_{pos}``."""
    position, kind = int(node["ctx_idx"]), node["feature_type"]
    token = _token(prompt_tokens, position)
    if kind == "embedding":
        return f"embedding @{position} {token}"
    if kind == "logit":
        return str(node["clerp"])
    if kind == "mlp reconstruction error":
        return f"error L{node['layer']} @{position} {token}"
    return f"L{node['layer']} F{parse_node_id(node['node_id'])[2]} @{position} {token}"  # "feature" is a Cantor pair


def _kind(node: dict[str, Any]) -> str:
    return _KINDS.get(node["feature_type"], "feature")


def _fit(text: str, width: float) -> str:
    """``text`` cut to the characters that fit ``width`` px (an ellipsis marking a cut)."""
    room = max(1, int(width // _CHAR_W))
    return text if len(text) <= room else text[:room - 1] + "…"


def _logit_text(node: dict[str, Any], width: float) -> str:
    """A logit's token (JSON-quoted; from its ``clerp``, else the clerp itself) cut to fit ``width`` px with its
    probability, which is never cut."""
    match = _CLERP.fullmatch(str(node.get("clerp", "")))
    token = json.dumps(match.group(1), ensure_ascii=False) if match else str(node.get("clerp", ""))
    probability = f" {float(node.get('token_prob') or 0.0):.3f}"
    room = width - len(probability) * _CHAR_W
    if match and len(token) * _CHAR_W > room:  # cut inside the quotes
        token = _fit(token[:-1], room - _CHAR_W) + '"'
    return _fit(token, room) + probability


class _Layout:
    """Where each node goes: the logits in slots of :data:`_LOGIT_W` px above the grid, the other nodes in cells
    (row = layer or the embeddings, column = position), most influential first in each cell."""

    def __init__(self, nodes: list[dict[str, Any]], n_pos: int) -> None:
        grid = [node for node in nodes if _kind(node) != "logit"]
        logits = sorted((node for node in nodes if _kind(node) == "logit"),
                        key=lambda n: (-float(n.get("token_prob") or 0.0), n["node_id"]))
        layers = sorted({int(n["layer"]) for n in grid if _kind(n) != "embedding"})
        self.row_names = ["emb", *(f"L{layer}" for layer in layers)]
        index = {name: row for row, name in enumerate(self.row_names)}
        cells: dict[tuple[int, int], list[dict[str, Any]]] = defaultdict(list)
        for node in grid:
            row = 0 if _kind(node) == "embedding" else index[f"L{node['layer']}"]
            cells[(row, int(node["ctx_idx"]))].append(node)
        per_cell = max(1, (_CELL_W - 10) // _NODE_STEP)
        lines = [max([-(-len(cells[(row, p)]) // per_cell) for p in range(n_pos)] + [1])
                 for row in range(len(self.row_names))]
        heights = [count * _NODE_STEP + _ROW_GAP for count in lines]
        self.width = _LEFT + max(n_pos * _CELL_W, min(max(len(logits), 1), 6) * _LOGIT_W) + _RIGHT
        per_line = max(1, (self.width - _LEFT - _RIGHT) // _LOGIT_W)
        logit_height = max(1, math.ceil(len(logits) / per_line)) * _LOGIT_LINE
        self.height = _TOP + logit_height + sum(heights) + _BOTTOM
        self.where: dict[str, tuple[float, float]] = {}
        self.logit_slots: list[tuple[dict[str, Any], float, float]] = []
        for i, node in enumerate(logits):
            x, y = _LEFT + (i % per_line) * _LOGIT_W + 6, _TOP + (i // per_line) * _LOGIT_LINE + _LOGIT_LINE / 2
            self.where[node["node_id"]] = (x, y)
            self.logit_slots.append((node, x, y))
        self.logit_top = _TOP + logit_height / 2
        bottom = self.height - _BOTTOM
        self.row_y = [bottom - sum(heights[:row]) - _ROW_GAP / 2 for row in range(len(self.row_names))]
        for (row, position), members in cells.items():
            members.sort(key=lambda n: (_influence_key(n), n["node_id"]))
            for i, node in enumerate(members):
                x = _LEFT + position * _CELL_W + 10 + (i % per_cell) * _NODE_STEP
                self.where[node["node_id"]] = (x, self.row_y[row] - (i // per_cell) * _NODE_STEP)


def _influence_key(node: dict[str, Any]) -> tuple[bool, float]:
    """Most influential first: ``influence`` is the node's cumulative share of influence (ascending = influence
    descending); nodes without one last."""
    value = node.get("influence")
    return value is None, float(value) if value is not None else 0.0


def _number(value: Any) -> str:
    return "" if value is None else f"{float(value):.4g}"


def _data_json(frontend: dict[str, Any], labels: list[str]) -> str:
    """The graph for the script, safe inside ``<script type="application/json">`` (no ``<``, ``>``, ``&`` or ``/``
    left as such)."""
    text = json.dumps({"frontend": frontend, "labels": labels}, ensure_ascii=False, separators=(",", ":"))
    return (text.replace("&", "\\u0026").replace("<", "\\u003c").replace(">", "\\u003e").replace("/", "\\/")
            .replace("\u2028", "\\u2028").replace("\u2029", "\\u2029"))


def _svg(nodes: list[dict[str, Any]], links: list[dict[str, Any]], tokens: list[str], n_pos: int) -> list[str]:
    layout, esc = _Layout(nodes, n_pos), html.escape
    width, height = layout.width, layout.height
    largest = max([abs(float(link["weight"])) for link in links] + [1e-30])
    parts = [f'<svg id="graph" width="{width}" height="{height}" viewBox="0 0 {width} {height}" role="img" '
             f'aria-label="attribution graph">']
    for position in range(n_pos):
        x = _LEFT + position * _CELL_W + 4
        parts.append(f'<text class="pos" x="{x}" y="{height - 14}">'
                     f'{esc(_fit(f"{position} {_token(tokens, position)}", _CELL_W - 8))}</text>')
    for name, y in zip(layout.row_names, layout.row_y):
        parts.append(f'<text class="row" x="6" y="{y + 4:.1f}">{name}</text>')
    parts.append(f'<text class="row" x="6" y="{layout.logit_top + 4:.1f}">logits</text>')
    for i, link in enumerate(links):
        (x1, y1), (x2, y2) = layout.where[link["source"]], layout.where[link["target"]]
        weight = float(link["weight"])
        parts.append(f'<line x1="{x1:.1f}" y1="{y1:.1f}" x2="{x2:.1f}" y2="{y2:.1f}" '
                     f'class="{"pos" if weight >= 0 else "neg"}" stroke-width="{0.4 + 3 * abs(weight) / largest:.2f}" '
                     f'data-i="{i}" data-source="{esc(link["source"])}" data-target="{esc(link["target"])}"/>')
    for node, x, y in layout.logit_slots:
        label = _logit_text(node, _LOGIT_W - _LABEL_X - 4)
        parts.append(f'<text class="logit-label" x="{x + _LABEL_X - 6:.1f}" y="{y + 4:.1f}">{esc(label)}</text>')
    for i, node in enumerate(nodes):
        x, y = layout.where[node["node_id"]]
        parts.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="5" class="{_kind(node)}" data-i="{i}" '
                     f'data-node="{esc(node["node_id"])}"/>')
    parts.append("</svg>")
    return parts


_LEGEND = ('<svg id="legend" width="760" height="22" role="img" aria-label="legend">'
           + "".join(f'<rect x="{x - 5}" y="6" width="10" height="10" rx="5" class="{kind}"/>'
                     f'<text x="{x + 9}" y="15">{text}</text>'
                     for x, kind, text in ((8, "feature", "feature"), (80, "error", "error (MLP reconstruction)"),
                                           (250, "embedding", "embedding"), (340, "logit", "logit")))
           + '<rect x="400" y="9" width="22" height="4" class="pos"/><text x="426" y="15">positive link</text>'
           + '<rect x="520" y="9" width="22" height="4" class="neg"/><text x="546" y="15">negative link</text>'
           + '<rect x="645" y="6" width="10" height="10" rx="5" class="feature chosen"/>'
           '<text x="659" y="15">selected</text></svg>'
           + "<p class=\"small\">Width of a link ∝ |weight|. In a supernode, a node's ring takes its group's colour. "
           "Shift-click nodes (or tick them in the table) to select them for a supernode.</p>")


def _header(metadata: dict[str, Any], nodes: list[dict[str, Any]], links: list[dict[str, Any]]) -> list[str]:
    esc = html.escape
    counts = {kind: sum(_kind(n) == kind for n in nodes) for kind in ("feature", "error", "embedding", "logit")}
    edge_threshold = (metadata.get("pruning_settings") or {}).get("edge_threshold")
    thresholds = esc(f"node threshold {metadata.get('node_threshold')}"
                     + (f", edge threshold {edge_threshold}" if edge_threshold is not None else ""))
    parts = [f"<p>Prompt: <b>{esc(str(metadata.get('prompt', '')))}</b></p>",
             f"<p>{len(nodes)} nodes ({counts['feature']} features, {counts['error']} errors, {counts['embedding']} "
             f"embeddings, {counts['logit']} logits), {len(links)} links; {thresholds}.</p>"]
    scores = metadata.get("scores")
    if scores:
        parts.append(f'<p id="scores">Replacement score <b>{float(scores["replacement_score"]):.3f}</b> (the share '
                     "of influence on the logits that reaches them from the tokens rather than from error nodes) · "
                     f'completeness score <b>{float(scores["completeness_score"]):.3f}</b> (the share of the nodes\' '
                     "direct inputs, weighted by influence, that is not error); both of the unpruned graph.</p>")
    else:
        parts.append('<p id="scores" class="small">Replacement and completeness scores: not in this graph.json '
                     "(gradpatch.circuits.annotate.annotate_frontend adds them).</p>")
    live = metadata.get("live_mlp_layers")
    if live:
        parts.append(f'<p id="live-mlps">Live MLPs (no transcoder; they run as in the model and their effect is '
                     f"folded into the links, with no node of their own): layers {', '.join(map(str, live))}.</p>")
    elif live is not None:
        parts.append('<p id="live-mlps">Every MLP layer has a transcoder (no live MLP).</p>')
    if counts["feature"] == 0:
        parts.append('<div id="no-features" class="warn"><b>Pruning kept no feature node.</b> The graph shows only '
                     "embeddings, error nodes and logits: the features carry less than the kept share of influence "
                     f"(or none fired). The thresholds ({thresholds}) are the shares of influence kept: raise "
                     "<code>--node-threshold</code> (e.g. 0.95; <code>node_threshold</code> of "
                     "<code>save_graph</code>) and <code>--edge-threshold</code> (e.g. 0.99) to keep more nodes and "
                     "links. A low replacement "
                     "score means error nodes carry most of the influence: better transcoders, or transcoders at more "
                     "layers, give features more.</div>")
    return parts


def _table(nodes: list[dict[str, Any]], labels: list[str]) -> list[str]:
    """The node table's rows, most influential first (:func:`_influence_key`); numeric cells carry their value in
    ``data-v`` for the script's sorting."""
    esc = html.escape
    rows = []
    order = sorted(range(len(nodes)), key=lambda i: (_influence_key(nodes[i]), nodes[i]["node_id"]))
    for rank, i in enumerate(order, 1):
        node = nodes[i]
        layer = None if _kind(node) in ("embedding", "logit") else int(node["layer"])
        numbers = [(v, _number(v) if isinstance(v, float) else ("" if v is None else str(v)))
                   for v in (layer, int(node["ctx_idx"]), node.get("activation"), node.get("influence"))]
        cells = "".join(f'<td data-v="{"" if v is None else v}">{text}</td>' for v, text in numbers)
        rows.append(f'<tr data-node="{esc(node["node_id"])}" data-i="{i}"><td><input type="checkbox" '
                    f'aria-label="select"></td><td data-v="{rank}">{rank}</td><td>{esc(labels[i])}</td>'
                    f'<td>{_kind(node)}</td>{cells}<td class="group"></td></tr>')
    head = "".join(f'<th data-col="{k}">{name}</th>' for k, name in enumerate(
        ["", "rank", "node", "kind", "layer", "position", "activation", "influence (cumulative share)", "supernode"]))
    return ['<table id="nodes"><thead><tr>', head, "</tr></thead><tbody>", *rows, "</tbody></table>"]


def graph_html(frontend: dict[str, Any]) -> str:
    """The page (module docstring) of ``frontend``, a ``graph.json`` document (``metadata``, ``qParams``, ``nodes``,
    ``links``; the optional fields of :mod:`gradpatch.circuits.annotate` shown where present)."""
    metadata, nodes, links = frontend["metadata"], frontend["nodes"], frontend["links"]
    tokens = [str(t) for t in metadata.get("prompt_tokens", [])]
    n_pos = max([len(tokens)] + [int(n["ctx_idx"]) + 1 for n in nodes])
    labels = [node_label(node, tokens) for node in nodes]
    labels_by_id = {node["node_id"]: label for node, label in zip(nodes, labels)}
    title = html.escape(str(metadata.get("slug", "attribution graph")))
    return "\n".join([
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">', f"<title>{title}</title>",
        f"<style>{STYLE}\n{HEADS_STYLE}</style></head><body>", f"<h1>{title}</h1>",
        *_header(metadata, nodes, links), _LEGEND,
        '<div id="main"><div id="drawing">', *_svg(nodes, links, tokens, n_pos), "</div>",
        '<div id="details"><p class="small">Click a node for its details, a link for its weight and head loadings; '
        "hover a node or a link for its label.</p></div></div>", *head_loadings_section(links, labels_by_id),
        '<div id="supernodes"><h2>Supernodes</h2><p><span id="sn-count">0 selected</span> · name <input '
        'id="sn-name" value="supernode"> <button id="sn-group">Group selected</button> <button id="sn-clear">Clear '
        'selection</button> · <button id="sn-download">Download graph.json with these supernodes</button> · load '
        'supernodes from a graph.json <input id="sn-load" type="file" accept=".json,application/json"></p>'
        '<p id="sn-msg" class="small"></p><ul id="sn-list"></ul></div>',
        "<h2>Nodes, most influential first</h2>", *_table(nodes, labels),
        '<div id="tip" hidden></div>',
        f'<script type="application/json" id="graph-data">{_data_json(frontend, labels)}</script>',
        f'<script id="graph-script">{SCRIPT}</script>', f'<script id="heads-script">{HEADS_SCRIPT}</script>',
        "</body></html>", ""])
