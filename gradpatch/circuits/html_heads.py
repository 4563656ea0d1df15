"""``graph.html``'s selected link and its head loadings (:func:`gradpatch.circuits.files.add_head_loadings`): the
page's list of the links that carry head loadings, and the script that shows a selected link.

A link is selected by clicking it in the drawing, by its entry in the list below the drawing
(:func:`head_loadings_section`), or by the ``edge`` / ``heads`` mark beside a node's strongest inputs and outputs
(click the node, or its row in the table, first). The details then name the link's source and target and its
weight and, where ``graph.json`` has them, its head loadings: per attention layer, the ``top`` heads of largest
|loading| with their values, the others' sum, the bypass, and bypass + Σ heads, which is the link's weight (each
attention layer's entries sum to the edge on their own; a path through heads of several layers counts at each).

The script's logic is the object ``GPH`` (no DOM needed: under node the script exports it and skips the page's
wiring); it runs after :mod:`gradpatch.circuits.html_script`'s, using its ``GP.fmt``, ``window.pick`` (to clear a
node's selection) and ``window.gpState`` (``pickedLink`` records the selected link's index).
"""

from __future__ import annotations

import html
from typing import Any

__all__ = ["HEADS_SCRIPT", "HEADS_STYLE", "TOP_HEADS", "head_loadings_section"]

#: Heads listed per attention layer in the details (the others are summed).
TOP_HEADS = 3

HEADS_STYLE = """#edge-heads td,#edge-heads th{font-size:11px;cursor:default}#hl-links li{margin:2px 0}
#hl-links a{cursor:pointer;color:#2050a0}line{cursor:pointer}"""


def head_loadings_section(links: list[dict[str, Any]], labels_by_id: dict[str, str]) -> list[str]:
    """The page's list of the links with head loadings, largest |weight| first (each entry's ``data-link`` the
    link's index in ``links``), or a line saying there are none.

    Args:
        links: ``graph.json``'s links.
        labels_by_id: node id -> its label (:func:`gradpatch.circuits.html.node_label`).
    """
    esc = html.escape
    loaded = sorted((i for i, link in enumerate(links) if link.get("head_loadings")),
                    key=lambda i: (-abs(float(links[i]["weight"])), i))
    if not loaded:
        return ['<div id="head-loadings"><p class="small">Head loadings: none in this graph.json (<code>gradpatch '
                'circuit --head-loadings</code>, or <code>save_graph(..., head_loadings=...)</code>, adds them to '
                "the logits' strongest links).</p></div>"]
    items = [f'<li><a data-link="{i}">{esc(labels_by_id[links[i]["source"]])} → '
             f'{esc(labels_by_id[links[i]["target"]])}</a> {float(links[i]["weight"]):.4g}</li>' for i in loaded]
    return ['<div id="head-loadings"><h2>Head loadings</h2>',
            f'<p class="small">{len(loaded)} links carry head loadings: how much of the edge each attention head '
            "carries, with attention patterns frozen. Click one (or a link in the drawing) to see them.</p>",
            '<ul id="hl-links">', *items, "</ul></div>"]


HEADS_SCRIPT = r"""
var GPH = (function () {
  "use strict";

  /* Per attention layer of a link's head_loadings ({total, layers: [{attention_layer, bypass, per_head}]}):
     {layer, bypass, top: [[head, loading], ...] (the k largest |loading|), others (how many more heads), rest (their
     sum), sum (bypass + every head's loading: the edge)}. */
  function layerRows(loadings, k) {
    return ((loadings && loadings.layers) || []).map(function (entry) {
      var heads = entry.per_head.map(function (value, head) { return [head, value]; })
        .sort(function (a, b) { return Math.abs(b[1]) - Math.abs(a[1]) || a[0] - b[0]; });
      var sum = entry.bypass, rest = 0;
      heads.forEach(function (pair, j) { sum += pair[1]; if (j >= k) rest += pair[1]; });
      return {layer: entry.attention_layer, bypass: entry.bypass, top: heads.slice(0, k),
              others: Math.max(0, heads.length - k), rest: rest, sum: sum};
    });
  }

  return {layerRows: layerRows};
})();

if (typeof module !== "undefined" && module.exports) module.exports = GPH;

if (typeof document !== "undefined") (function () {
  "use strict";
  var TOP = __TOP__;
  var data = JSON.parse(document.getElementById("graph-data").textContent);
  var nodes = data.frontend.nodes, links = data.frontend.links, labels = data.labels, index = {};
  nodes.forEach(function (n, i) { index[n.node_id] = i; });
  var details = document.getElementById("details"), svg = document.getElementById("graph");
  var fmt = typeof GP !== "undefined" ? GP.fmt : String;

  function el(tag, text, cls) {
    var e = document.createElement(tag);
    if (text !== undefined && text !== null) e.textContent = text;
    if (cls) e.className = cls;
    return e;
  }

  function nodeLink(id) {
    var a = el("a", labels[index[id]]);
    a.addEventListener("click", function () { if (window.pick) window.pick(id); });
    return a;
  }

  function headTable(loadings) {
    var table = el("table"), head = el("tr");
    table.id = "edge-heads";
    ["attention layer", "top heads by |loading|", "bypass", "bypass + \u03a3 heads"].forEach(function (name) {
      head.appendChild(el("th", name));
    });
    table.appendChild(head);
    GPH.layerRows(loadings, TOP).forEach(function (row) {
      var tr = el("tr"), heads = row.top.map(function (pair) { return "h" + pair[0] + " " + fmt(pair[1]); });
      if (row.others) heads.push("+" + row.others + (row.others === 1 ? " other " : " others ") + fmt(row.rest));
      [String(row.layer), heads.join("; "), fmt(row.bypass), fmt(row.sum)].forEach(function (text) {
        tr.appendChild(el("td", text));
      });
      table.appendChild(tr);
    });
    return table;
  }

  function pickLink(i) {
    var link = links[i];
    if (!link) return;
    if (window.pick) window.pick(null);
    document.querySelectorAll("line.hi").forEach(function (l) { l.classList.remove("hi"); });
    var line = document.querySelector('line[data-i="' + i + '"]');
    if (line) line.classList.add("hi");
    svg.classList.add("picked");
    if (window.gpState) window.gpState.pickedLink = i;
    details.textContent = "";
    var title = el("h3");
    title.appendChild(nodeLink(link.source));
    title.appendChild(document.createTextNode(" \u2192 "));
    title.appendChild(nodeLink(link.target));
    details.appendChild(title);
    details.appendChild(el("p", "link weight: " + fmt(link.weight)));
    var loadings = link.head_loadings;
    if (!loadings) {
      details.appendChild(el("p", "Head loadings: not computed for this link (gradpatch circuit --head-loadings " +
                                  "computes them for the logits' strongest links).", "small"));
      return;
    }
    details.appendChild(el("b", "Head loadings"));
    details.appendChild(el("p", "Per attention layer, the heads' loadings and the bypass (the paths around that " +
                                "layer's attention) sum to the edge, " + fmt(loadings.total) + " (the link's weight " +
                                "up to rounding); a path through heads of several layers counts at each. Layers " +
                                "not listed carry none of it through their heads.", "small"));
    details.appendChild(headTable(loadings));
  }
  window.gpPickLink = pickLink;

  svg.addEventListener("click", function (ev) {
    if (ev.target.tagName === "line" && ev.target.dataset.i !== undefined) pickLink(+ev.target.dataset.i);
  });
  document.querySelectorAll("#hl-links a[data-link]").forEach(function (a) {
    a.addEventListener("click", function () { pickLink(+a.dataset.link); });
  });
})();
""".replace("__TOP__", str(TOP_HEADS))
