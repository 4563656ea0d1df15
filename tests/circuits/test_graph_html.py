"""graph.html (gradpatch.circuits.html) and the fields it reads (gradpatch.circuits.annotate): the page's structure
on hand-made graph.json documents (labelled logits that never overlap, legend, scores, live MLPs, the message when no
feature node is kept, the table sorted by influence, the embedded data), the annotations on tiny Llama and GPT-2
replacement models (scores, live MLP layers, top logits through the final norm, snippets, Neuronpedia's schema), the
page's script under node (sorting, labels, supernodes saved and loaded), and the page in a headless Chromium when one
is found (clicks, grouping, the download, label boxes, a screenshot)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from gradpatch import PatchableGraph, testing
from gradpatch.circuits import (CircuitError, ReplacementModel, attribute, frontend_graph, graph_html, graph_scores,
                                node_label)
from gradpatch.circuits.annotate import annotate_frontend, decoder_logit_weights, live_mlp_layers
from gradpatch.circuits.node_ids import cantor_pair, parse_node_id
from gradpatch.dictionaries import SkipTranscoder

#: Neuronpedia's graph schema, as copied beside these tests (see neuronpedia_graph_schema.SOURCE.md).
SCHEMA = Path(__file__).with_name("neuronpedia_graph_schema.json")


# --- hand-made graph.json documents --------------------------------------------------------------------------------

def _node(node_id: str, kind: str, layer: str, position: int, feature: int, influence: float | None = None,
          **extra: Any) -> dict[str, Any]:
    return {"node_id": node_id, "feature": feature, "layer": layer, "ctx_idx": position, "feature_type": kind,
            "jsNodeId": node_id, "clerp": "", "token_prob": 0.0, "is_target_logit": False, "run_idx": 0,
            "reverse_ctx_idx": 0, "influence": influence, "activation": None, **extra}


def _frontend(n_features: int = 6, n_logits: int = 4, token: str = " Paris", n_pos: int = 3) -> dict[str, Any]:
    """A small graph.json: embeddings at each position, features on layers 0-1, one error, ``n_logits`` logits whose
    token is ``token`` followed by its index; influence decreasing with the feature's index."""
    tokens = ["<s>", " The", " capital"][:n_pos] + [f" t{i}" for i in range(max(0, n_pos - 3))]
    nodes = [_node(f"E_{10 + p}_{p}", "embedding", "E", p, p, influence=0.1 + 0.01 * p) for p in range(n_pos)]
    features = [_node(f"{i % 2}_{i}_{n_pos - 1}", "cross layer transcoder", str(i % 2), n_pos - 1,
                      cantor_pair(i % 2, i), influence=0.3 + 0.1 * i, activation=1.0 + i) for i in range(n_features)]
    error = _node(f"1_-1_{n_pos - 1}", "mlp reconstruction error", "1", n_pos - 1, -1, influence=0.25)
    logits = [_node(f"3_{50 + i}_{n_pos - 1}", "logit", "3", n_pos - 1, 50 + i, token_prob=0.5 / (i + 1),
                    clerp=f'Output "{token}{i}" (p={0.5 / (i + 1):.3f})') for i in range(n_logits)]
    nodes += features + [error] + logits
    links = [{"source": nodes[p]["node_id"], "target": f["node_id"], "weight": 0.5 - p} for p in range(n_pos)
             for f in features]
    links += [{"source": f["node_id"], "target": logit["node_id"], "weight": (-1) ** i * 0.3}
              for i, f in enumerate(features) for logit in logits]
    links += [{"source": error["node_id"], "target": logits[0]["node_id"], "weight": 0.1}] if logits else []
    metadata = {"slug": "hand", "scan": "hand", "transcoder_list": [], "node_threshold": 0.8, "prompt": "The capital",
                "prompt_tokens": tokens}
    query = {"pinnedIds": [], "supernodes": [], "linkType": "both", "clickedId": "", "sg_pos": ""}
    return {"metadata": metadata, "qParams": query, "nodes": nodes, "links": links}


class _Page(HTMLParser):
    """Tags (with attributes and the text inside each), and the elements left open."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str | None], list[str]]] = []
        self.open: list[tuple[str, list[str]]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        text: list[str] = []
        self.tags.append((tag, dict(attrs), text))
        if tag not in ("meta", "br", "img", "input", "link"):
            self.open.append((tag, text))

    def handle_endtag(self, tag: str) -> None:
        assert self.open and self.open[-1][0] == tag, (tag, [t for t, _ in self.open[-5:]])
        self.open.pop()

    def handle_data(self, data: str) -> None:
        for _, text in self.open:
            text.append(data)


def _parse(page: str) -> _Page:
    parser = _Page()
    parser.feed(page.split("<!DOCTYPE html>", 1)[1])
    parser.close()
    assert parser.open == []
    return parser


def _text(parser: _Page, tag: str, **attrs: str) -> list[str]:
    return ["".join(text) for t, a, text in parser.tags if t == tag and all(a.get(k) == v for k, v in attrs.items())]


def _embedded(page: str) -> dict[str, Any]:
    block = re.search(r'<script type="application/json" id="graph-data">(.*?)</script>', page, re.DOTALL)
    return json.loads(block.group(1))


def test_page_is_self_contained_and_draws_every_node_and_link() -> None:
    frontend = _frontend()
    page = graph_html(frontend)
    assert not re.search(r"https?://|//cdn|<link|\bsrc=|@import|url\(", page)  # nothing fetched
    parser = _parse(page)
    circles = [a["data-node"] for t, a, _ in parser.tags if t == "circle" and "data-node" in a]
    assert sorted(circles) == sorted(n["node_id"] for n in frontend["nodes"])
    assert all("data-node" in a for t, a, _ in parser.tags if t == "circle")  # the legend draws no circle
    lines = [(a["data-source"], a["data-target"]) for t, a, _ in parser.tags if t == "line"]
    assert lines == [(link["source"], link["target"]) for link in frontend["links"]]
    assert _embedded(page) == {"frontend": frontend, "labels": [node_label(n, frontend["metadata"]["prompt_tokens"])
                                                                for n in frontend["nodes"]]}


def test_embedded_data_survives_text_that_would_end_a_script() -> None:
    frontend = _frontend(token='</script><b>&"x')
    page = graph_html(frontend)
    assert page.count("</script>") == 3  # the data block's and the two scripts', no other
    assert _embedded(page)["frontend"] == frontend


def test_logits_are_labelled_with_token_and_probability_and_never_overlap() -> None:
    frontend = _frontend(n_logits=23, token=" a very long token text indeed")
    parser = _parse(graph_html(frontend))
    labels = [(float(a["x"]), float(a["y"]), "".join(text)) for t, a, text in parser.tags
              if t == "text" and a.get("class") == "logit-label"]
    assert len(labels) == 23
    assert len({y for _, y, _ in labels}) > 1  # too many for one line: they wrap
    assert labels[0][2].startswith('" a very') and labels[0][2].endswith('…" 0.500')  # token cut, not p
    short = _parse(graph_html(_frontend(n_logits=3, token=" Paris")))
    texts = _text(short, "text", **{"class": "logit-label"})
    assert texts == ['" Paris0" 0.500', '" Paris1" 0.250', '" Paris2" 0.167']  # highest probability first
    char_width = 7.0  # 11px monospace: at most 7 px a character
    for x, y, text in labels:
        for x2, y2, _ in labels:
            if y2 == y and x2 > x:
                assert x + len(text) * char_width < x2
    circles = {a["data-node"]: (float(a["cx"]), float(a["cy"])) for t, a, _ in parser.tags
               if t == "circle" and a.get("class") == "logit"}
    assert len(set(circles.values())) == 23  # no two logit circles on one spot


def test_header_gives_counts_scores_live_mlps_and_the_legend() -> None:
    frontend = _frontend()
    frontend["metadata"]["scores"] = {"replacement_score": 0.6125, "completeness_score": 0.875}
    frontend["metadata"]["live_mlp_layers"] = [2, 5]
    parser = _parse(graph_html(frontend))
    text = " ".join(_text(parser, "p"))
    assert "6 features, 1 errors, 3 embeddings, 4 logits" in text
    scores = " ".join(_text(parser, "p", id="scores"))
    assert re.search(r"Replacement score 0\.613 .* completeness score 0\.875", scores)
    assert "layers 2, 5" in " ".join(_text(parser, "p", id="live-mlps"))
    legend = " ".join(_text(parser, "svg", id="legend"))
    assert all(word in legend for word in ("feature", "error", "embedding", "logit", "positive link", "negative link"))
    assert not _text(parser, "div", id="no-features")
    bare = _parse(graph_html(_frontend()))  # no annotations: said so, nothing invented
    assert "not in this graph.json" in " ".join(_text(bare, "p", id="scores"))
    assert not _text(bare, "p", id="live-mlps")
    every = _frontend()
    every["metadata"]["live_mlp_layers"] = []
    assert "Every MLP layer has a transcoder" in " ".join(_text(_parse(graph_html(every)), "p", id="live-mlps"))


def test_a_graph_without_feature_nodes_says_why_and_what_to_do() -> None:
    parser = _parse(graph_html(_frontend(n_features=0)))
    message = " ".join(_text(parser, "div", id="no-features"))
    assert "Pruning kept no feature node" in message
    assert "raise --node-threshold" in message and "--edge-threshold" in message


def test_table_is_sorted_by_influence() -> None:
    frontend = _frontend()
    page = graph_html(frontend)
    parser = _parse(page)
    order = [a["data-node"] for t, a, _ in parser.tags if t == "tr" and "data-node" in a]
    by_id = {n["node_id"]: n for n in frontend["nodes"]}
    shares = [by_id[node_id]["influence"] for node_id in order]
    known = [s for s in shares if s is not None]
    assert known == sorted(known) and shares[len(known):] == [None] * (len(shares) - len(known))
    assert len(order) == len(frontend["nodes"])
    labels = {n["node_id"]: node_label(n, frontend["metadata"]["prompt_tokens"]) for n in frontend["nodes"]}
    rows = [text for t, a, text in parser.tags if t == "tr" and "data-node" in a]
    assert all(labels[node_id] in "".join(text) for node_id, text in zip(order, rows))


# --- annotations on tiny replacement models ------------------------------------------------------------------------

_FAMILIES = {"llama": ("model.layers_{}.mlp.x", "model.layers_{}.mlp.output"),
             "gpt2": ("transformer.h_{}.mlp.hidden_states", "transformer.h_{}.mlp.output")}


def _replacement(family: str, layers: tuple[int, ...], dtype: torch.dtype = torch.float32) -> ReplacementModel:
    """The tiny ``family`` model (2 layers) with random ReLU skip transcoders (64 latents) at ``layers``, in
    ``dtype``."""
    if family == "llama":
        model = testing.tiny_llama(100, hidden=64, intermediate=128, init_std=0.02, max_position_embeddings=64,
                                   pad_token_id=None, bos_token_id=1, eos_token_id=2)
    else:
        model = testing.tiny_gpt2(100, hidden=64, init_std=0.02, n_positions=64)
    model = model.to(dtype)
    ids = torch.randint(0, 100, (1, 6), generator=torch.Generator().manual_seed(3))
    read, write = _FAMILIES[family]
    generator = torch.Generator().manual_seed(0)
    transcoders = {}
    for layer in layers:
        transcoder = SkipTranscoder(64, 64, activation="relu", input_node=read.format(layer),
                                    output_node=write.format(layer), generator=generator)
        with torch.no_grad():
            transcoder.W_skip.normal_(0, 0.05, generator=generator)
        transcoders[layer] = transcoder.to(dtype)
    return ReplacementModel(PatchableGraph(model, ids, use_cache=False), transcoders, ids)


@pytest.fixture(scope="module", params=sorted(_FAMILIES))
def annotated(request) -> tuple[ReplacementModel, Any, dict[str, Any], dict[str, Any]]:
    torch.manual_seed(0)
    replacement = _replacement(request.param, (0, 1))
    graph = attribute(replacement, batch_size=32)
    frontend = frontend_graph(graph, decode=lambda t: f"tok{t}")
    features = [n for n in frontend["nodes"] if n["feature_type"] == "cross layer transcoder"]
    first = parse_node_id(features[0]["node_id"])[::2]
    snippets = {first: [SimpleNamespace(text=f"a «b» {i}", activation=9.0 - i) for i in range(5)]}
    result = annotate_frontend(frontend, graph, replacement, decode=lambda t: f"tok{t}", snippets=snippets, top_k=3)
    return replacement, graph, frontend, result


def test_annotations_give_the_scores_and_leave_the_input_alone(annotated) -> None:
    replacement, graph, frontend, result = annotated
    replacement_score, completeness_score = graph_scores(graph)
    assert result["metadata"]["scores"] == {"replacement_score": replacement_score,
                                            "completeness_score": completeness_score}
    assert result["metadata"]["live_mlp_layers"] == []
    assert "scores" not in frontend["metadata"] and all("top_logits" not in n for n in frontend["nodes"])
    assert [n["node_id"] for n in result["nodes"]] == [n["node_id"] for n in frontend["nodes"]]
    with pytest.raises(CircuitError, match="top_k=0: give at least 1"):
        annotate_frontend(frontend, graph, replacement, top_k=0)


def test_live_mlp_layers_are_those_without_a_transcoder() -> None:
    assert live_mlp_layers(_replacement("llama", (1,))) == [0]
    assert live_mlp_layers(_replacement("gpt2", (0,))) == [1]


def _norm_by_hand(replacement: ReplacementModel, directions: torch.Tensor) -> torch.Tensor:
    """The final norm's scale-invariant part by hand: γ ⊙ d / rms(d) (RMSNorm), γ ⊙ (d − mean) / std (LN)."""
    model = replacement.pg.wrapped_model
    if hasattr(model, "transformer"):
        norm = model.transformer.ln_f
        centred = directions - directions.mean(-1, keepdim=True)
        return norm.weight * centred / (centred.pow(2).mean(-1, keepdim=True) + norm.eps).sqrt()
    norm = model.model.norm
    return norm.weight * directions / (directions.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon).sqrt()


def test_top_logits_are_the_decoder_direction_through_the_final_norm_and_unembedding(annotated) -> None:
    replacement, _, _, result = annotated
    model = replacement.pg.wrapped_model
    with torch.no_grad():
        for node in (n for n in result["nodes"] if n["feature_type"] == "cross layer transcoder"):
            layer, _, feature = parse_node_id(node["node_id"])
            direction = replacement.layers[layer].transcoder.W_dec[feature]
            expected = _norm_by_hand(replacement, direction[None]) @ model.get_output_embeddings().weight.T
            top = expected[0].topk(3)
            bottom = expected[0].topk(3, largest=False)
            assert [t["token"] for t in node["top_logits"]] == top.indices.tolist()
            assert [t["token"] for t in node["bottom_logits"]] == bottom.indices.tolist()
            torch.testing.assert_close(torch.tensor([t["weight"] for t in node["top_logits"]]), top.values)
            assert [t["text"] for t in node["top_logits"]] == [f"tok{t}" for t in top.indices.tolist()]
    assert all("top_logits" not in n for n in result["nodes"] if n["feature_type"] != "cross layer transcoder")


def test_decoder_logit_weights_without_a_norm_is_the_plain_product() -> None:
    directions, W_U = torch.randn(3, 8), torch.randn(11, 8)  # noqa: N806
    torch.testing.assert_close(decoder_logit_weights(directions, W_U), directions @ W_U.T)
    # a norm's bias and the directions' scale set no rank: only γ and the centring do
    norm = torch.nn.LayerNorm(8)
    with torch.no_grad():
        norm.bias.normal_()
    weights = decoder_logit_weights(5 * directions, W_U, norm)
    assert torch.equal(weights.argsort(dim=-1), decoder_logit_weights(directions, W_U, norm).argsort(dim=-1))


def test_snippets_go_to_their_feature_only(annotated) -> None:
    _, _, _, result = annotated
    with_snippets = [n for n in result["nodes"] if "top_snippets" in n]
    assert with_snippets and len({parse_node_id(n["node_id"])[::2] for n in with_snippets}) == 1
    assert with_snippets[0]["top_snippets"] == [{"text": f"a «b» {i}", "activation": 9.0 - i} for i in range(3)]


def test_annotated_graph_json_keeps_neuronpedias_schema(annotated) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    _, _, frontend, result = annotated
    validator = jsonschema.Draft7Validator(json.loads(SCHEMA.read_text()))
    assert list(validator.iter_errors(json.loads(json.dumps(result)))) == []
    broken = json.loads(json.dumps(result))
    del broken["nodes"][0]["jsNodeId"]  # the check can fail
    assert list(validator.iter_errors(broken))


def test_annotated_page_names_the_scores(annotated) -> None:
    _, graph, _, result = annotated
    parser = _parse(graph_html(result))
    assert f"{graph_scores(graph)[0]:.3f}" in " ".join(_text(parser, "p", id="scores"))


# --- the page's script ---------------------------------------------------------------------------------------------

def _script(page: str) -> str:
    return re.search(r'<script id="graph-script">(.*?)</script>', page, re.DOTALL).group(1)


_NODE_CHECKS = r"""
const GP = require(process.argv[2]);
const assert = require("assert");
const out = {};
out.order = GP.sortedOrder([0.5, null, 0.1, "", 0.3], false);
out.orderDesc = GP.sortedOrder([0.5, null, 0.1, "", 0.3], true);
out.text = GP.sortedOrder(["b", "a", "c"], false);
const known = {"1_2_3": 0, "0_4_3": 1, "E_5_0": 2};
out.parsed = GP.parseSupernodes({qParams: {supernodes: [["say Paris", "1_2_3", "gone", "0_4_3"], ["empty", "nope"],
                                                        ["dup", "1_2_3", "E_5_0"]]}}, known);
out.fromString = GP.parseSupernodes({qParams: {supernodes: '[["s", "E_5_0"]]'}}, known).groups;
let groups = GP.addGroup([["a", "1_2_3", "0_4_3"]], "b", ["0_4_3", "E_5_0"]);
out.added = groups;
out.moved = GP.addGroup(groups, "c", ["1_2_3"]);
out.renamed = GP.renameGroup(groups, 1, "");
out.removed = GP.removeGroup(groups, 0);
const frontend = {qParams: {pinnedIds: ["E_5_0"], supernodes: []}, nodes: [], links: []};
const saved = GP.withSupernodes(frontend, groups);
out.saved = saved.qParams;
out.untouched = frontend.qParams;
out.roundTrip = GP.parseSupernodes(JSON.parse(JSON.stringify(saved)), known).groups;
out.link = GP.linkLabel(["L0 F2 @3 \"x\"", "Output \" Paris\" (p=0.500)"], {a: 0, b: 1},
                        {source: "a", target: "b", weight: -0.012345});
out.strongest = GP.strongestLinks([{source: "a", target: "b", weight: 0.1}, {source: "c", target: "b", weight: -2},
                                   {source: "b", target: "c", weight: 5}], {a: 0, b: 1, c: 2}, 1, "in", 5)
  .map(pair => [pair[0].source, pair[1]]);
console.log(JSON.stringify(out));
"""


@pytest.mark.skipif(shutil.which("node") is None, reason="no node on the PATH")
def test_script_logic_under_node(tmp_path: Path) -> None:
    """Sorting (empty values last either way), link labels, strongest links and supernodes (parsed as circuit-tracer
    stores them, grouped, renamed, removed, saved with their members pinned, and read back)."""
    (tmp_path / "page.js").write_text(_script(graph_html(_frontend())))
    (tmp_path / "checks.js").write_text(_NODE_CHECKS)
    run = subprocess.run(["node", str(tmp_path / "checks.js"), str(tmp_path / "page.js")], capture_output=True,
                         text=True, timeout=60, check=True)
    out = json.loads(run.stdout)
    assert out["order"] == [2, 4, 0, 1, 3] and out["orderDesc"] == [0, 4, 2, 1, 3] and out["text"] == [1, 0, 2]
    assert out["parsed"] == {"groups": [["say Paris", "1_2_3", "0_4_3"], ["dup", "E_5_0"]], "dropped": ["gone", "nope"]}
    assert out["fromString"] == [["s", "E_5_0"]]
    assert out["added"] == [["a", "1_2_3"], ["b", "0_4_3", "E_5_0"]]
    assert out["moved"] == [["b", "0_4_3", "E_5_0"], ["c", "1_2_3"]]  # group "a" emptied, so dropped
    assert out["renamed"] == [["a", "1_2_3"], ["supernode", "0_4_3", "E_5_0"]]
    assert out["removed"] == [["b", "0_4_3", "E_5_0"]]
    assert out["saved"]["supernodes"] == out["added"]
    assert out["saved"]["pinnedIds"] == ["E_5_0", "1_2_3", "0_4_3"]
    assert out["untouched"] == {"pinnedIds": ["E_5_0"], "supernodes": []}
    assert out["roundTrip"] == out["added"]
    assert out["link"] == 'L0 F2 @3 "x" → Output " Paris" (p=0.500): -0.01235'
    assert out["strongest"] == [["c", 2], ["a", 0]]


# --- in a headless browser -----------------------------------------------------------------------------------------

def _browser() -> str | None:
    """A headless Chromium: $GRADPATCH_BROWSER, else chromium-headless-shell or chromium on the PATH."""
    found = os.environ.get("GRADPATCH_BROWSER") or shutil.which("chromium-headless-shell") or shutil.which("chromium")
    return found if found and Path(found).exists() else None


_PROBE = r"""<script>
(function () {
  var out = {}, state = window.gpState, data = JSON.parse(document.getElementById("graph-data").textContent);
  var nodes = data.frontend.nodes;
  out.loadedGroups = state.groups;
  out.groupCells = Array.from(document.querySelectorAll("#nodes td.group")).map(td => td.textContent).filter(t => t);
  out.listed = document.getElementById("sn-list").textContent;
  var features = nodes.map((n, i) => i).filter(i => nodes[i].feature_type === "cross layer transcoder");
  var circle = i => document.querySelector('circle[data-i="' + i + '"]');
  circle(features[0]).dispatchEvent(new MouseEvent("click", {bubbles: true}));
  out.details = document.getElementById("details").textContent;
  out.highlighted = Array.from(document.querySelectorAll("line.hi")).map(l => [l.dataset.source, l.dataset.target]);
  out.picked = nodes[features[0]].node_id;
  var line = document.querySelector("line");
  line.dispatchEvent(new MouseEvent("mouseover", {bubbles: true, clientX: 5, clientY: 5}));
  out.linkTip = document.getElementById("tip").textContent;
  circle(features[0]).dispatchEvent(new MouseEvent("mouseover", {bubbles: true, clientX: 5, clientY: 5}));
  out.nodeTip = document.getElementById("tip").textContent;
  out.chosen = [features[1], features[2]].map(i => nodes[i].node_id);
  [features[1], features[2]].forEach(i => circle(i).dispatchEvent(new MouseEvent("click",
                                                                                  {bubbles: true, shiftKey: true})));
  document.getElementById("sn-name").value = "my group";
  document.getElementById("sn-group").click();
  out.groups = state.groups;
  out.memberStroke = circle(features[1]).style.stroke;
  out.saved = JSON.parse(state.download()).qParams;
  document.querySelector('#nodes th[data-col="6"]').click();
  document.querySelector('#nodes th[data-col="6"]').click();
  out.activations = Array.from(document.querySelectorAll("#nodes tbody tr")).map(r => r.children[6].dataset.v);
  var boxes = Array.from(document.querySelectorAll("text.logit-label")).map(t => t.getBBox())
    .map(b => [b.x, b.y, b.x + b.width, b.y + b.height]);
  out.overlaps = 0;
  boxes.forEach((a, i) => boxes.forEach((b, j) => {
    if (i < j && a[0] < b[2] && b[0] < a[2] && a[1] < b[3] && b[1] < a[3]) out.overlaps += 1;
  }));
  out.labelBoxes = boxes.length;
  var pre = document.createElement("pre");
  pre.id = "probe";
  pre.textContent = JSON.stringify(out);
  document.body.appendChild(pre);
})();
</script></body>"""


def _run_browser(page: Path, *args: str) -> str:
    return subprocess.run([_browser(), "--headless", "--no-sandbox", "--disable-gpu", *args, page.as_uri()],
                          capture_output=True, text=True, timeout=120, check=True).stdout


@pytest.mark.browser
@pytest.mark.skipif(_browser() is None, reason="no headless browser (set GRADPATCH_BROWSER or install chromium)")
def test_page_in_a_headless_browser(annotated, tmp_path: Path) -> None:
    """Supernodes loaded from qParams, a click's details and highlighted links, readable tooltips, shift-click
    grouping and its download, re-sorting, label boxes that do not overlap, and a screenshot."""
    _, _, _, result = annotated
    result = json.loads(json.dumps(result))
    features = [n["node_id"] for n in result["nodes"] if n["feature_type"] == "cross layer transcoder"]
    embedding = next(n["node_id"] for n in result["nodes"] if n["feature_type"] == "embedding")
    result["qParams"]["supernodes"] = [["loaded", embedding, "not_a_node"]]
    page = tmp_path / "graph.html"
    page.write_text(graph_html(result))
    (tmp_path / "probe.html").write_text(page.read_text().replace("</body>", _PROBE))
    dom = _run_browser(tmp_path / "probe.html", "--dump-dom")
    out = json.loads(re.search(r'<pre id="probe">(.*?)</pre>', dom, re.DOTALL).group(1).replace("&quot;", '"')
                     .replace("&lt;", "<").replace("&gt;", ">").replace("&amp;", "&"))
    assert out["loadedGroups"] == [["loaded", embedding]] and out["groupCells"] == ["loaded"]
    labels = {n["node_id"]: node_label(n, result["metadata"]["prompt_tokens"]) for n in result["nodes"]}
    first = next(n for n in result["nodes"] if n["node_id"] == out["picked"])
    assert labels[out["picked"]] in out["details"]
    assert all(t["text"] in out["details"] for t in first["top_logits"] + first["bottom_logits"])
    assert "a «b» 0" in out["details"] or "top_snippets" not in first
    assert out["highlighted"] and all(out["picked"] in pair for pair in out["highlighted"])
    link = result["links"][0]
    assert out["linkTip"].startswith(f"{labels[link['source']]} → {labels[link['target']]}: ")
    assert out["nodeTip"].startswith(labels[out["picked"]]) and "promotes" in out["nodeTip"]
    assert out["groups"] == [["loaded", embedding], ["my group", *out["chosen"]]]
    assert out["memberStroke"]
    assert out["saved"]["supernodes"] == out["groups"]
    assert set(out["saved"]["pinnedIds"]) == {embedding, *out["chosen"]}
    activations = [float(v) for v in out["activations"] if v != ""]
    assert activations == sorted(activations, reverse=True) and len(activations) == len(features)
    assert out["labelBoxes"] == sum(n["feature_type"] == "logit" for n in result["nodes"]) and out["overlaps"] == 0
    shot = tmp_path / "graph.png"
    _run_browser(page, f"--screenshot={shot}", "--window-size=1400,1000")
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000
