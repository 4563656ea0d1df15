"""The style sheet and script of ``graph.html`` (:mod:`gradpatch.circuits.html`), inlined in the page.

The script reads the graph from the page's ``<script type="application/json" id="graph-data">`` block
(``{"frontend": graph.json, "labels": [node label, ...]}``). Its logic (sorting, labels, supernodes: parsing,
grouping, the ``graph.json`` they are saved in) is the object ``GP``, which needs no DOM: run under node, the script
exports it (``module.exports``) and skips the page's wiring, so that tests can call it directly.

Supernodes follow circuit-tracer's frontend (``attribution_graph/init-cg-subgraph.js``): ``qParams.supernodes`` is a
list of ``[name, node_id, ...]``, and only pinned nodes (``qParams.pinnedIds``) are drawn in its subgraph, so saving
adds the members to ``pinnedIds``. Here a node belongs to one supernode at most: grouping takes the selected nodes
out of any earlier group (a group left empty is dropped).
"""

from __future__ import annotations

__all__ = ["SCRIPT", "STYLE"]

STYLE = """body{font-family:sans-serif;margin:16px;color:#222}h1{font-size:20px}h2{font-size:16px}
.small{font-size:12px;color:#555}.warn{background:#fff3cd;border:1px solid #e0b000;padding:8px;margin:8px 0}
#main{display:flex;align-items:flex-start;gap:12px}#drawing{overflow:auto;max-width:72vw;max-height:80vh;
border:1px solid #ccc}#graph{background:#fff;display:block}
#details{position:sticky;top:8px;width:26vw;min-width:260px;max-height:80vh;overflow:auto;font-size:12px;
border:1px solid #ccc;padding:6px}#details h3{font-size:13px;margin:2px 0 6px}
#details ul{margin:2px 0;padding-left:16px}
#details a{cursor:pointer;color:#2050a0}
line{stroke-opacity:.35}line.pos{stroke:#2060c0}line.neg{stroke:#c03020}#graph.picked line{stroke-opacity:.08}
#graph.picked line.hi,line.hi{stroke-opacity:1}rect.pos{fill:#2060c0}rect.neg{fill:#c03020}
circle,#legend rect[rx]{stroke:#333;stroke-width:.8;cursor:pointer}.feature{fill:#f0c040}.error{fill:#aaa}
.embedding{fill:#70b070}.logit{fill:#a070d0}circle.sel{stroke:#000;stroke-width:2.5}
circle.member{stroke-width:3}.chosen{stroke:#ff00aa!important;stroke-width:3!important;stroke-dasharray:2 1.5}
text{font-size:11px}text.logit-label,text.pos{font-family:monospace}text.row{fill:#555}
table{border-collapse:collapse;font-size:12px;margin-top:8px}td,th{border:1px solid #ddd;padding:2px 6px}
th{cursor:pointer;background:#f4f4f4}th.asc::after{content:" \\25B2"}th.desc::after{content:" \\25BC"}
tr.sel{background:#ffe9a0}tr.chosen td{background:#ffd6f0}
#tip{position:fixed;pointer-events:none;background:#fffff0;border:1px solid #999;padding:3px 6px;font-size:12px;
max-width:480px;z-index:10}#sn-list li{margin:3px 0}.swatch{display:inline-block;width:10px;height:10px;
border-radius:5px;margin-right:4px}"""

SCRIPT = r"""
var GP = (function () {
  "use strict";
  var PALETTE = ["#e6194b", "#3cb44b", "#4363d8", "#f58231", "#911eb4", "#42d4f4", "#f032e6", "#9a6324"];

  function fmt(value) {
    if (value === null || value === undefined || value === "") return "";
    var number = Number(value);
    return Math.abs(number) >= 1e-3 && Math.abs(number) < 1e4 ? String(Number(number.toPrecision(4)))
      : number.toExponential(3);
  }

  /* Compare for sorting: numbers as numbers, text as text; empty values (null, "") last either way. */
  function compare(a, b, descending) {
    var aEmpty = a === null || a === undefined || a === "", bEmpty = b === null || b === undefined || b === "";
    if (aEmpty || bEmpty) return aEmpty === bEmpty ? 0 : (aEmpty ? 1 : -1);
    var result = (typeof a === "number" && typeof b === "number") ? a - b : String(a).localeCompare(String(b));
    return descending ? -result : result;
  }

  /* The indices of values in sorted order (stable: ties keep their order). */
  function sortedOrder(values, descending) {
    return values.map(function (v, i) { return i; }).sort(function (i, j) {
      return compare(values[i], values[j], descending) || i - j;
    });
  }

  function linkLabel(labels, index, link) {
    return labels[index[link.source]] + " \u2192 " + labels[index[link.target]] + ": " + fmt(link.weight);
  }

  /* The k links of node i with largest |weight|, incoming ("in") or outgoing ("out"): [[link, other node index]]. */
  function strongestLinks(links, index, i, direction, k) {
    var own = direction === "in" ? "target" : "source", other = direction === "in" ? "source" : "target";
    return links.filter(function (l) { return index[l[own]] === i; })
      .sort(function (a, b) { return Math.abs(b.weight) - Math.abs(a.weight); })
      .slice(0, k).map(function (l) { return [l, index[l[other]]]; });
  }

  /* Supernodes from a graph.json, a {qParams: ...} object or a bare list: [[name, id, ...], ...] keeping only the
     ids in known (an object id -> anything), each id in one group at most; groups left empty are dropped. */
  function parseSupernodes(raw, known) {
    var list = Array.isArray(raw) ? raw : (raw && raw.qParams && raw.qParams.supernodes) || (raw && raw.supernodes);
    if (typeof list === "string") list = JSON.parse(list);
    var groups = [], dropped = [], seen = {};
    (Array.isArray(list) ? list : []).forEach(function (entry) {
      if (!Array.isArray(entry) || entry.length < 2) return;
      var ids = [];
      entry.slice(1).forEach(function (id) {
        id = String(id);
        if (!Object.prototype.hasOwnProperty.call(known, id)) dropped.push(id);
        else if (!seen[id]) { seen[id] = true; ids.push(id); }
      });
      if (ids.length) groups.push([String(entry[0] || "supernode")].concat(ids));
    });
    return {groups: groups, dropped: dropped};
  }

  /* groups with a new group [name, ...ids] appended; the ids leave earlier groups, which are dropped if empty. */
  function addGroup(groups, name, ids) {
    var taken = {};
    ids.forEach(function (id) { taken[id] = true; });
    var kept = groups.map(function (g) {
      return [g[0]].concat(g.slice(1).filter(function (id) { return !taken[id]; }));
    }).filter(function (g) { return g.length > 1; });
    return ids.length ? kept.concat([[name || "supernode"].concat(ids)]) : kept;
  }

  function renameGroup(groups, i, name) {
    return groups.map(function (g, j) { return j === i ? [name || "supernode"].concat(g.slice(1)) : g; });
  }

  function removeGroup(groups, i) {
    return groups.filter(function (g, j) { return j !== i; });
  }

  /* node id -> index of its group. */
  function groupOf(groups) {
    var result = {};
    groups.forEach(function (g, i) { g.slice(1).forEach(function (id) { result[id] = i; }); });
    return result;
  }

  /* A copy of graph.json with qParams.supernodes = groups and every member in qParams.pinnedIds. */
  function withSupernodes(frontend, groups) {
    var copy = JSON.parse(JSON.stringify(frontend));
    var query = copy.qParams || {};
    var pinned = (query.pinnedIds || []).slice(), has = {};
    pinned.forEach(function (id) { has[id] = true; });
    groups.forEach(function (g) {
      g.slice(1).forEach(function (id) { if (!has[id]) { has[id] = true; pinned.push(id); } });
    });
    query.supernodes = groups.map(function (g) { return g.slice(); });
    query.pinnedIds = pinned;
    copy.qParams = query;
    return copy;
  }

  return {PALETTE: PALETTE, fmt: fmt, compare: compare, sortedOrder: sortedOrder, linkLabel: linkLabel,
          strongestLinks: strongestLinks, parseSupernodes: parseSupernodes, addGroup: addGroup,
          renameGroup: renameGroup, removeGroup: removeGroup, groupOf: groupOf, withSupernodes: withSupernodes};
})();

if (typeof module !== "undefined" && module.exports) module.exports = GP;

if (typeof document !== "undefined") (function () {
  "use strict";
  var data = JSON.parse(document.getElementById("graph-data").textContent);
  var frontend = data.frontend, nodes = frontend.nodes, links = frontend.links, labels = data.labels;
  var index = {}, circles = [], rows = [], linesOf = nodes.map(function () { return []; });
  nodes.forEach(function (n, i) { index[n.node_id] = i; });
  document.querySelectorAll("circle[data-node]").forEach(function (c) { circles[+c.dataset.i] = c; });
  document.querySelectorAll("#nodes tbody tr").forEach(function (r) { rows[+r.dataset.i] = r; });
  var lines = Array.prototype.slice.call(document.querySelectorAll("line[data-i]"));
  lines.forEach(function (line) {
    var link = links[+line.dataset.i];
    linesOf[index[link.source]].push(line);
    if (link.target !== link.source) linesOf[index[link.target]].push(line);
  });
  var svg = document.getElementById("graph"), tip = document.getElementById("tip");
  var details = document.getElementById("details");
  var state = {groups: [], chosen: {}, picked: null, sortColumn: null, descending: false};
  window.gpState = state;

  function el(tag, text, cls) {
    var e = document.createElement(tag);
    if (text !== undefined && text !== null) e.textContent = text;
    if (cls) e.className = cls;
    return e;
  }

  function nodeSummary(i) {
    var n = nodes[i], parts = [labels[i]];
    if (n.activation !== null && n.activation !== undefined) parts.push("activation " + GP.fmt(n.activation));
    if (n.influence !== null && n.influence !== undefined) parts.push("influence " + GP.fmt(n.influence));
    if (n.feature_type === "logit") parts.push("p=" + GP.fmt(n.token_prob));
    var top = (n.top_logits || []).slice(0, 3).map(function (t) { return JSON.stringify(t.text); });
    if (top.length) parts.push("promotes " + top.join(", "));
    return parts.join(" \u00b7 ");
  }

  function tokenList(title, entries) {
    var box = el("div");
    box.appendChild(el("b", title));
    var list = el("ul");
    entries.forEach(function (t) { list.appendChild(el("li", JSON.stringify(t.text) + "  " + GP.fmt(t.weight))); });
    box.appendChild(list);
    return box;
  }

  function linkList(title, entries) {
    var box = el("div");
    box.appendChild(el("b", title));
    var list = el("ul");
    entries.forEach(function (pair) {
      var item = el("li"), a = el("a", labels[pair[1]]);
      a.addEventListener("click", function () { pick(nodes[pair[1]].node_id); });
      item.appendChild(a);
      item.appendChild(document.createTextNode("  " + GP.fmt(pair[0].weight) + " "));
      var edge = el("a", pair[0].head_loadings ? "heads" : "edge");  /* the link's details: html_heads.py */
      edge.addEventListener("click", function () { window.gpPickLink(links.indexOf(pair[0])); });
      item.appendChild(edge);
      list.appendChild(item);
    });
    if (!entries.length) list.appendChild(el("li", "none kept"));
    box.appendChild(list);
    return box;
  }

  function showDetails(i) {
    var n = nodes[i];
    details.textContent = "";
    details.appendChild(el("h3", labels[i]));
    var facts = ["kind: " + n.feature_type, "id: " + n.node_id];
    if (n.activation !== null && n.activation !== undefined) facts.push("activation: " + GP.fmt(n.activation));
    if (n.influence !== null && n.influence !== undefined) {
      facts.push("influence (cumulative share): " + GP.fmt(n.influence));
    }
    if (n.feature_type === "logit") facts.push("probability: " + GP.fmt(n.token_prob));
    var group = GP.groupOf(state.groups)[n.node_id];
    if (group !== undefined) facts.push("supernode: " + state.groups[group][0]);
    details.appendChild(el("p", facts.join(" \u00b7 ")));
    var isFeature = ["embedding", "logit", "mlp reconstruction error"].indexOf(n.feature_type) < 0;
    if (n.top_logits || n.bottom_logits) {
      details.appendChild(tokenList("Promotes (top logits of its decoder direction)", n.top_logits || []));
      details.appendChild(tokenList("Suppresses", n.bottom_logits || []));
    } else if (isFeature) {
      details.appendChild(el("p", "Top logits: not in this graph.json (annotate_frontend adds them).", "small"));
    }
    if (n.top_snippets) {
      var box = el("div"), list = el("ul");
      box.appendChild(el("b", "Top activating snippets"));
      n.top_snippets.forEach(function (s) { list.appendChild(el("li", GP.fmt(s.activation) + "  " + s.text)); });
      box.appendChild(list);
      details.appendChild(box);
    } else if (isFeature) {
      details.appendChild(el("p", "Top activating snippets: none given.", "small"));
    }
    details.appendChild(linkList("Strongest inputs", GP.strongestLinks(links, index, i, "in", 8)));
    details.appendChild(linkList("Strongest outputs", GP.strongestLinks(links, index, i, "out", 8)));
  }

  function pick(id) {
    var i = index[id];
    document.querySelectorAll(".sel").forEach(function (e) { e.classList.remove("sel"); });
    document.querySelectorAll("line.hi").forEach(function (l) { l.classList.remove("hi"); });
    state.picked = i === undefined ? null : i;
    svg.classList.toggle("picked", i !== undefined);
    if (i === undefined) return;
    linesOf[i].forEach(function (l) { l.classList.add("hi"); });
    circles[i].classList.add("sel");
    rows[i].classList.add("sel");
    showDetails(i);
  }
  window.pick = pick;

  function choose(i, on) {
    var id = nodes[i].node_id;
    if (on) state.chosen[id] = true; else delete state.chosen[id];
    circles[i].classList.toggle("chosen", on);
    rows[i].classList.toggle("chosen", on);
    rows[i].querySelector("input").checked = on;
    document.getElementById("sn-count").textContent = Object.keys(state.chosen).length + " selected";
  }

  function message(text) { document.getElementById("sn-msg").textContent = text; }

  function renderGroups() {
    var owner = GP.groupOf(state.groups), list = document.getElementById("sn-list");
    nodes.forEach(function (n, i) {
      var g = owner[n.node_id];
      circles[i].classList.toggle("member", g !== undefined);
      circles[i].style.stroke = g === undefined ? "" : GP.PALETTE[g % GP.PALETTE.length];
      rows[i].querySelector("td.group").textContent = g === undefined ? "" : state.groups[g][0];
    });
    list.textContent = "";
    state.groups.forEach(function (g, k) {
      var item = el("li"), swatch = el("span", null, "swatch"), name = el("input");
      swatch.style.background = GP.PALETTE[k % GP.PALETTE.length];
      name.value = g[0];
      name.addEventListener("change", function () {
        state.groups = GP.renameGroup(state.groups, k, name.value);
        renderGroups();
      });
      var show = el("button", "select members"), remove = el("button", "remove");
      show.addEventListener("click", function () {
        nodes.forEach(function (n, i) { choose(i, g.indexOf(n.node_id) > 0); });
      });
      remove.addEventListener("click", function () { state.groups = GP.removeGroup(state.groups, k); renderGroups(); });
      item.appendChild(swatch);
      item.appendChild(name);
      item.appendChild(document.createTextNode(" " + (g.length - 1) + " nodes: " + g.slice(1).map(function (id) {
        return labels[index[id]];
      }).join("; ") + " "));
      item.appendChild(show);
      item.appendChild(remove);
      list.appendChild(item);
    });
  }

  function loadSupernodes(raw, source) {
    var parsed = GP.parseSupernodes(raw, index);
    state.groups = parsed.groups;
    renderGroups();
    message(parsed.groups.length || parsed.dropped.length ? parsed.groups.length + " supernodes loaded from " + source +
            (parsed.dropped.length ? "; ids not in this graph left out: " + parsed.dropped.join(", ") : "") : "");
  }

  function sortTable(column) {
    var tbody = document.querySelector("#nodes tbody");
    state.descending = state.sortColumn === column ? !state.descending : false;
    state.sortColumn = column;
    var values = rows.map(function (r) {
      var cell = r.children[column];
      if (cell.hasAttribute("data-v")) return cell.dataset.v === "" ? null : Number(cell.dataset.v);
      return column === 0 ? (r.querySelector("input").checked ? 0 : 1) : cell.textContent;
    });
    GP.sortedOrder(values, state.descending).forEach(function (i) { tbody.appendChild(rows[i]); });
    document.querySelectorAll("#nodes th").forEach(function (th) {
      th.classList.toggle("asc", +th.dataset.col === column && !state.descending);
      th.classList.toggle("desc", +th.dataset.col === column && state.descending);
    });
  }

  function download() {
    var text = JSON.stringify(GP.withSupernodes(frontend, state.groups), null, 1);
    var a = document.createElement("a");
    a.download = "graph.json";
    a.href = URL.createObjectURL(new Blob([text], {type: "application/json"}));
    document.body.appendChild(a);
    a.click();
    a.remove();
    return text;
  }
  state.download = download;

  svg.addEventListener("click", function (ev) {
    var t = ev.target;
    if (t.tagName !== "circle") return;
    var i = +t.dataset.i;
    if (ev.shiftKey || ev.ctrlKey || ev.metaKey) choose(i, !state.chosen[nodes[i].node_id]);
    else pick(nodes[i].node_id);
  });
  svg.addEventListener("mouseover", function (ev) {
    var t = ev.target, text = null;
    if (t.tagName === "circle") text = nodeSummary(+t.dataset.i);
    else if (t.tagName === "line") text = GP.linkLabel(labels, index, links[+t.dataset.i]);
    if (text === null) { tip.hidden = true; return; }
    tip.textContent = text;
    tip.hidden = false;
    tip.style.left = (ev.clientX + 14) + "px";
    tip.style.top = (ev.clientY + 14) + "px";
  });
  svg.addEventListener("mouseleave", function () { tip.hidden = true; });
  document.querySelector("#nodes tbody").addEventListener("click", function (ev) {
    var row = ev.target.closest("tr");
    if (!row) return;
    if (ev.target.tagName === "INPUT") choose(+row.dataset.i, ev.target.checked);
    else pick(row.dataset.node);
  });
  document.querySelectorAll("#nodes th").forEach(function (th) {
    th.addEventListener("click", function () { sortTable(+th.dataset.col); });
  });
  document.getElementById("sn-group").addEventListener("click", function () {
    var ids = nodes.map(function (n) { return n.node_id; }).filter(function (id) { return state.chosen[id]; });
    if (ids.length < 1) {
      message("Select nodes first: shift-click them in the drawing, or tick them in the table.");
      return;
    }
    state.groups = GP.addGroup(state.groups, document.getElementById("sn-name").value, ids);
    nodes.forEach(function (n, i) { choose(i, false); });
    renderGroups();
    message("Grouped " + ids.length + " nodes. Download graph.json to keep the supernodes.");
  });
  document.getElementById("sn-clear").addEventListener("click", function () {
    nodes.forEach(function (n, i) { choose(i, false); });
  });
  document.getElementById("sn-download").addEventListener("click", download);
  document.getElementById("sn-load").addEventListener("change", function (ev) {
    var file = ev.target.files[0];
    if (!file) return;
    var reader = new FileReader();
    reader.onload = function () {
      try { loadSupernodes(JSON.parse(reader.result), file.name); }
      catch (error) { message("Could not read " + file.name + ": " + error.message); }
    };
    reader.readAsText(file);
  });
  state.sort = sortTable;
  state.choose = choose;
  state.group = function () { document.getElementById("sn-group").click(); };
  loadSupernodes(frontend.qParams || {}, "graph.json");
})();
"""
