"""Head loadings in graph.json and graph.html (gradpatch.circuits.files.add_head_loadings, save_graph's
``head_loadings``, gradpatch.circuits.html_heads): on the tiny Llama and GPT-2 in float64 with random skip
transcoders, the links of graph.json whose edges were split carry per attention layer a bypass and one loading per
head that sum to the split edge (within 1e-6 of Σ|terms|) and to the link's weight (within 1e-5 relative for links
of at least 1% of their row's largest: the rows are float32), graph.json still passes Neuronpedia's schema, and the
sparse store beside the adjacency reads back whole; bad loadings are refused; the page lists the links with
loadings, its script's per-layer rows under node, and in a headless Chromium a selected link shows its top heads,
bypass and sum; ``gradpatch circuit --head-loadings`` puts them into graph.json."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch
from test_graph_html import _browser, _parse, _replacement, _run_browser, _text

from gradpatch.circuits import (AttributionGraph, CircuitError, HeadLoadings, ReplacementModel, add_head_loadings,
                                attribute, frontend_graph, graph_html, head_loadings, load_head_loadings, node_label,
                                parse_node_id, save_graph)
from gradpatch.circuits.files import graph_node_ids
from gradpatch.circuits.html_heads import HEADS_SCRIPT, TOP_HEADS
from gradpatch.files.loaders import load_model
from recipes import cli
from recipes.testing import save_tiny_backbone, save_tiny_transcoders

SCHEMA = json.loads(Path(__file__).with_name("neuronpedia_graph_schema.json").read_text())


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def split(request) -> tuple[ReplacementModel, AttributionGraph, HeadLoadings]:
    """A float64 tiny model's graph and the head loadings of every edge into its logit nodes and its last feature."""
    torch.manual_seed(0)
    replacement = _replacement(request.param, (0, 1), torch.float64)
    graph = attribute(replacement, batch_size=32)
    targets = [*range(graph.logit_start, graph.n_nodes), graph.n_features - 1]
    return replacement, graph, head_loadings(replacement, graph, targets)


@pytest.fixture(scope="module")
def saved(split, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """``save_graph`` of the graph with its head loadings (default pruning): the folder and its graph.json."""
    _, graph, loadings = split
    folder = tmp_path_factory.mktemp("graph")
    save_graph(graph, folder, prompt="p", scan="tiny", head_loadings=loadings)
    return folder, json.loads((folder / "graph.json").read_text())


def test_links_carry_loadings_that_sum_to_their_weight(split, saved) -> None:
    _, graph, loadings = split
    _, document = saved
    assert list(jsonschema.Draft7Validator(SCHEMA).iter_errors(document)) == []
    bare = {k: v for k, v in document.items() if k != "links"}
    assert list(jsonschema.Draft7Validator(SCHEMA).iter_errors(bare))  # the check can fail
    plain = frontend_graph(graph, scan="tiny")["links"]
    assert [(l["source"], l["target"], l["weight"]) for l in document["links"]] == [
        (l["source"], l["target"], l["weight"]) for l in plain]
    heads = loadings.heads
    assert document["metadata"]["head_loadings"]["heads"] == heads
    index = {node_id: i for i, node_id in enumerate(graph_node_ids(graph))}
    split_edges = {(int(t), int(s)) for t, s, _ in loadings.edges.tolist()}
    carried = [link for link in document["links"] if "head_loadings" in link]
    assert {(index[l["target"]], index[l["source"]]) for l in carried} == {
        (index[l["target"]], index[l["source"]]) for l in document["links"]} & split_edges
    assert document["metadata"]["head_loadings"]["links"] == len(carried) > 20
    rows = {int(node): row for node, row in zip(graph.target_nodes.tolist(), graph.rows)}
    checked, bypass_matters = 0, False
    for link in carried:
        weight, split_link = link["weight"], link["head_loadings"]
        target, source = index[link["target"]], index[link["source"]]
        largest = float(rows[target].abs().max())  # the rows are float32: a small edge is rounded on that scale
        assert split_link["total"] == pytest.approx(weight, rel=1e-5, abs=1e-6 * largest)
        expected = loadings.edge(target, source)
        listed = [entry["attention_layer"] for entry in split_link["layers"]]
        assert listed == sorted(layer for layer, (per_head, _) in expected.items() if per_head.any())
        for entry in split_link["layers"]:
            assert len(entry["per_head"]) == heads[entry["attention_layer"]]
            summed = entry["bypass"] + sum(entry["per_head"])
            size = abs(entry["bypass"]) + sum(abs(v) for v in entry["per_head"])
            assert abs(summed - split_link["total"]) <= 1e-6 * size  # tests/circuits/test_head_loadings.py's bounds
            assert abs(weight) < 1e-2 * largest or summed == pytest.approx(weight, rel=1e-5)
            bypass_matters |= abs(sum(entry["per_head"]) - weight) > 1e-3 * abs(weight)
            checked += 1
    assert checked > 20 and bypass_matters  # the heads alone do not make the edge: the bypass is needed


def test_the_sparse_store_beside_the_adjacency_reads_back(split, saved, tmp_path: Path) -> None:
    _, _, loadings = split
    folder, _ = saved
    assert {"adjacency.safetensors", "head_loadings.safetensors", "head_loadings.json"} <= {
        p.name for p in folder.iterdir()}
    back = load_head_loadings(folder)
    assert torch.equal(back.indices, loadings.indices) and back.heads == loadings.heads
    torch.testing.assert_close(back.values.double(), loadings.values.double(), rtol=1e-6, atol=0.0)
    with pytest.raises(CircuitError, match="save_head_loadings"):
        load_head_loadings(tmp_path)


def test_bad_loadings_are_refused_and_the_input_is_left_alone(split) -> None:
    _, graph, loadings = split
    frontend = frontend_graph(graph, scan="tiny")
    before = json.dumps(frontend)
    assert any("head_loadings" in link for link in add_head_loadings(frontend, graph, loadings)["links"])
    assert json.dumps(frontend) == before
    other = HeadLoadings(loadings.indices, loadings.values, loadings.edges + torch.tensor([graph.n_nodes, 0, 0]),
                         loadings.heads)
    with pytest.raises(CircuitError, match="computed on this graph"):
        add_head_loadings(frontend, graph, other)
    poisoned = HeadLoadings(loadings.indices, torch.full_like(loadings.values, float("nan")), loadings.edges,
                            loadings.heads)
    with pytest.raises(CircuitError, match="NaN"):
        add_head_loadings(frontend, graph, poisoned)


# --- the page ------------------------------------------------------------------------------------------------------

def test_page_lists_the_links_with_loadings(saved) -> None:
    folder, document = saved
    parser = _parse((folder / "graph.html").read_text())
    entries = [(int(a["data-link"]), "".join(text)) for t, a, text in parser.tags if t == "a" and "data-link" in a]
    carried = [i for i, link in enumerate(document["links"]) if "head_loadings" in link]
    assert sorted(i for i, _ in entries) == carried
    weights = [abs(document["links"][i]["weight"]) for i, _ in entries]
    assert weights == sorted(weights, reverse=True)
    labels = {n["node_id"]: node_label(n, document["metadata"]["prompt_tokens"]) for n in document["nodes"]}
    link = document["links"][entries[0][0]]
    assert entries[0][1] == f"{labels[link['source']]} → {labels[link['target']]}"
    bare = _parse(graph_html(dict(document, links=[{k: v for k, v in link.items() if k != "head_loadings"}
                                                  for link in document["links"]])))
    assert "none in this graph.json" in " ".join(_text(bare, "div", id="head-loadings"))


_NODE_CHECKS = r"""
const GPH = require(process.argv[2]);
const loadings = {total: 1.5, layers: [{attention_layer: 0, bypass: 0.5, per_head: [0.1, -0.6, 0.0, 1.5]},
                                       {attention_layer: 1, bypass: 1.5, per_head: [0.0, 0.0]}]};
console.log(JSON.stringify({rows: GPH.layerRows(loadings, 2), none: GPH.layerRows(undefined, 2)}));
"""


@pytest.mark.skipif(shutil.which("node") is None, reason="no node on the PATH")
def test_layer_rows_under_node(tmp_path: Path) -> None:
    """Per attention layer: the k heads of largest |loading| (ties by head index), how many others and their sum, the
    bypass, and bypass + Σ heads."""
    (tmp_path / "heads.js").write_text(HEADS_SCRIPT)
    (tmp_path / "checks.js").write_text(_NODE_CHECKS)
    run = subprocess.run(["node", str(tmp_path / "checks.js"), str(tmp_path / "heads.js")], capture_output=True,
                         text=True, timeout=60, check=True)
    out = json.loads(run.stdout)
    first, second = out["rows"]
    assert first["layer"] == 0 and first["top"] == [[3, 1.5], [1, -0.6]] and first["others"] == 2
    assert first["rest"] == pytest.approx(0.1) and first["sum"] == pytest.approx(1.5) and first["bypass"] == 0.5
    assert second["top"] == [[0, 0.0], [1, 0.0]] and second["others"] == 0 and second["sum"] == 1.5
    assert out["none"] == []


_PROBE = r"""<script>
(function () {
  var out = {}, links = JSON.parse(document.getElementById("graph-data").textContent).frontend.links;
  var rows = function () {
    return Array.from(document.querySelectorAll("#edge-heads tr")).slice(1)
      .map(function (r) { return Array.from(r.children).map(function (c) { return c.textContent; }); });
  };
  var entry = document.querySelector("#hl-links a[data-link]");
  entry.dispatchEvent(new MouseEvent("click", {bubbles: true}));
  out.listed = {link: +entry.dataset.link, picked: window.gpState.pickedLink, rows: rows(),
                details: document.getElementById("details").textContent,
                highlighted: Array.from(document.querySelectorAll("line.hi")).map(function (l) {
                  return +l.dataset.i;
                })};
  var bare = Array.from(document.querySelectorAll("line[data-i]")).find(function (l) {
    return !links[+l.dataset.i].head_loadings;
  });
  bare.dispatchEvent(new MouseEvent("click", {bubbles: true}));
  out.bare = {link: +bare.dataset.i, details: document.getElementById("details").textContent, rows: rows().length};
  var line = document.querySelector('line[data-i="' + out.listed.link + '"]');
  line.dispatchEvent(new MouseEvent("click", {bubbles: true}));
  out.clicked = {picked: window.gpState.pickedLink, rows: rows()};
  window.pick(links[out.listed.link].target);
  out.afterNode = Array.from(document.querySelectorAll("line.hi")).length;
  var mark = Array.from(document.querySelectorAll("#details a")).find(function (a) {
    return a.textContent === "heads";
  });
  mark.dispatchEvent(new MouseEvent("click", {bubbles: true}));
  out.fromNode = {picked: window.gpState.pickedLink, rows: rows().length};
  entry.dispatchEvent(new MouseEvent("click", {bubbles: true}));
  var pre = document.createElement("pre");
  pre.id = "probe";
  pre.textContent = JSON.stringify(out);
  document.body.appendChild(pre);
})();
</script></body>"""


def _fmt(value: float) -> str:
    """The page's number format (GP.fmt): 4 significant digits, exponent form outside [1e-3, 1e4)."""
    if 1e-3 <= abs(value) < 1e4:
        return repr(float(f"{value:.4g}")).removesuffix(".0")
    return f"{value:.3e}".replace("e-0", "e-").replace("e+0", "e+")


@pytest.mark.browser
@pytest.mark.skipif(_browser() is None, reason="no headless browser (set GRADPATCH_BROWSER or install chromium)")
def test_a_selected_link_shows_its_head_loadings_in_a_browser(saved, tmp_path: Path) -> None:
    """Picked from the list, clicked in the drawing or from a node's inputs: the link is highlighted and the details
    show per attention layer its top heads by |loading|, the others' sum, the bypass and bypass + Σ heads (the
    weight); a link without loadings says they were not computed; and a screenshot."""
    folder, document = saved
    page = (folder / "graph.html").read_text()
    (tmp_path / "probe.html").write_text(page.replace("</body>", _PROBE))
    dom = _run_browser(tmp_path / "probe.html", "--dump-dom")
    out = json.loads(re.search(r'<pre id="probe">(.*?)</pre>', dom, re.DOTALL).group(1).replace("&quot;", '"')
                     .replace("&lt;", "<").replace("&gt;", ">").replace("&amp;", "&"))
    listed = out["listed"]
    link = document["links"][listed["link"]]
    assert listed["picked"] == listed["link"] and listed["highlighted"] == [listed["link"]]
    assert "Head loadings" in listed["details"] and "sum to the edge" in listed["details"]
    assert f"link weight: {_fmt(link['weight'])}" in listed["details"]
    layers = link["head_loadings"]["layers"]
    assert [int(row[0]) for row in listed["rows"]] == [entry["attention_layer"] for entry in layers]
    for row, entry in zip(listed["rows"], layers):
        order = sorted(range(len(entry["per_head"])), key=lambda h: (-abs(entry["per_head"][h]), h))
        shown = [f"h{h} {_fmt(entry['per_head'][h])}" for h in order[:TOP_HEADS]]
        if len(order) > TOP_HEADS:
            rest = sum(entry["per_head"][h] for h in order[TOP_HEADS:])
            shown.append(f"+{len(order) - TOP_HEADS} other{'s' if len(order) - TOP_HEADS > 1 else ''} {_fmt(rest)}")
        assert row[1] == "; ".join(shown)
        assert float(row[2]) == pytest.approx(entry["bypass"], rel=1e-3, abs=1e-12)
        assert float(row[3]) == pytest.approx(link["weight"], rel=1e-3)  # 4 significant digits shown
    assert "not computed for this link" in out["bare"]["details"] and out["bare"]["rows"] == 0
    assert "head_loadings" not in document["links"][out["bare"]["link"]]
    assert out["clicked"] == {"picked": listed["link"], "rows": listed["rows"]}
    assert out["afterNode"] > 0 and out["fromNode"]["rows"] > 0  # a node's links, then one of them via "heads"
    shot = tmp_path / "graph.png"
    _run_browser(tmp_path / "probe.html", f"--screenshot={shot}", "--window-size=1400,1000")
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000


# --- the command ---------------------------------------------------------------------------------------------------

def test_the_circuit_command_puts_head_loadings_into_graph_json(tmp_path: Path) -> None:
    """``gradpatch circuit --head-loadings``: the kept links into the logits whose edges were split (each logit's
    strongest sources, head_loadings.json) carry their loadings in graph.json (float32: each layer's terms sum to the
    split edge within float rounding of the terms), and graph.html lists them."""
    model_dir = save_tiny_backbone(tmp_path / "tiny")
    model, _ = load_model(model_dir)
    save_tiny_transcoders(tmp_path / "dictionaries", model)
    out = tmp_path / "out"
    assert cli.main(["circuit", "--prompt", "the capital of France is Paris and the capital of Italy is",
                     "--dictionaries", str(tmp_path / "dictionaries"), "--model", str(model_dir), "--device", "cpu",
                     "--out", str(out), "--head-loadings", "--head-loading-sources", "4", "--quiet"]) == 0
    document = json.loads((out / "graph.json").read_text())
    assert list(jsonschema.Draft7Validator(SCHEMA).iter_errors(document)) == []
    by_key = {_node_key(n["feature_type"], *parse_node_id(n["node_id"])): n["node_id"] for n in document["nodes"]}
    ids = {r["index"]: by_key.get(_record_key(r)) for r in json.loads((out / "nodes.json").read_text())["nodes"]}
    split_edges = {(ids[e["source"]], ids[e["target"]]): e
                   for e in json.loads((out / "head_loadings.json").read_text())["edges"]}
    logits = [n["node_id"] for n in document["nodes"] if n["feature_type"] == "logit"]
    assert len(split_edges) == 4 * len(logits)
    carried = {(link["source"], link["target"]): link for link in document["links"] if "head_loadings" in link}
    assert set(carried) == {(link["source"], link["target"]) for link in document["links"]} & set(split_edges)
    assert carried and document["metadata"]["head_loadings"]["links"] == len(carried)
    for pair, link in carried.items():
        assert link["head_loadings"]["total"] == split_edges[pair]["weight"]
        assert link["head_loadings"]["total"] == pytest.approx(link["weight"], rel=1e-4, abs=1e-6)
        for entry in link["head_loadings"]["layers"]:
            terms = [entry["bypass"], *entry["per_head"]]
            assert abs(sum(terms) - link["head_loadings"]["total"]) <= 3e-5 * sum(abs(v) for v in terms)
    page = _parse((out / "graph.html").read_text())
    assert len([a for t, a, _ in page.tags if t == "a" and "data-link" in a]) == len(carried)


def _node_key(kind: str, layer: int, position: int, feature: int) -> tuple[Any, ...]:
    """A graph.json node (its kind and parsed id) as :func:`_record_key` gives the same node in nodes.json."""
    if kind == "mlp reconstruction error":
        return "error", layer, position
    return {"embedding": "token", "logit": "logit"}.get(kind, "feature"), position, feature, (
        layer if kind == "cross layer transcoder" else None)


def _record_key(record: dict[str, Any]) -> tuple[Any, ...]:
    if record["kind"] == "error":
        return "error", record["layer"], record["position"]
    return record["kind"], record["position"], record["feature"], record["layer"]
