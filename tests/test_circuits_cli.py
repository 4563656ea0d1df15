"""``gradpatch circuit`` on the tiny Llama saved to disk with random skip transcoders at both MLPs (gradpatch's
``layer_<i>/`` layout and circuit-tracer's ``config.yaml``): the files, graph.html (parsed, and in a headless browser
when one is found), TensorBoard's summaries, ``--max-feature-nodes`` (circuit-tracer's choice of features),
interventions (:func:`gradpatch.circuits.intervene`) and the errors for bad input (status 2, nothing written)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from gradpatch import PatchableGraph
from gradpatch.circuits import (CircuitError, FeatureEdit, NoPathError, ReplacementModel, attribute, intervene,
                                limit_features, node_label, visit_order)
from gradpatch.dictionaries import SkipTranscoder, export_circuit_tracer, save_dictionary
from gradpatch.files.loaders import load_model
from gradpatch.patches import AddPatch
from recipes import cli
from recipes.testing import save_tiny_backbone

PROMPT = "the capital of France is Paris and the capital of Italy is"


def _transcoders(seed: int = 0) -> dict[int, SkipTranscoder]:
    generator = torch.Generator().manual_seed(seed)
    transcoders = {}
    for layer in range(2):
        transcoder = SkipTranscoder(64, 64, activation="relu", input_node=f"model.layers_{layer}.mlp.x",
                                    output_node=f"model.layers_{layer}.mlp.output", generator=generator)
        with torch.no_grad():
            transcoder.W_skip.normal_(0, 0.05, generator=generator)
        transcoders[layer] = transcoder
    return transcoders


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny backbone, its transcoders in both layouts, and one ``gradpatch circuit`` run with an intervention."""
    torch.set_num_threads(1)
    folder = tmp_path_factory.mktemp("circuit_cli")
    model_dir = save_tiny_backbone(folder / "tiny")
    model, _ = load_model(model_dir)
    for layer, transcoder in _transcoders().items():
        save_dictionary(transcoder, folder / "dictionaries" / f"layer_{layer}", model=model)
    export_circuit_tracer(_transcoders(), folder / "circuit_tracer", "tiny", "hook_resid_mid", "mlp.hook_out")
    out = folder / "out"
    assert cli.main(["circuit", "--prompt", PROMPT, "--dictionaries", str(folder / "dictionaries"),
                     "--model", str(model_dir), "--device", "cpu", "--batch-size", "64", "--out", str(out),
                     "--intervene", "ablate:0:3:5", "--intervene", "steer:1:-1:7=2.5"]) == 0
    return {"model": model_dir, "dictionaries": folder / "dictionaries", "circuit_tracer": folder / "circuit_tracer",
            "out": out}


def _replacement(saved: dict[str, Path]) -> tuple[ReplacementModel, object]:
    model, tokenizer = load_model(saved["model"])
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    return ReplacementModel(PatchableGraph(model, ids, use_cache=False), _transcoders(), ids), tokenizer


def test_circuit_writes_the_graph_html_and_tensorboard(saved: dict[str, Path]) -> None:
    out = saved["out"]
    assert {p.name for p in out.iterdir()} == {"adjacency.safetensors", "nodes.json", "graph.json", "graph.html",
                                               "interventions.json", "tensorboard"}
    replacement, tokenizer = _replacement(saved)
    expected = attribute(replacement)
    tensors = load_file(out / "adjacency.safetensors")
    torch.testing.assert_close(tensors["adjacency"], expected.adjacency, rtol=1e-4, atol=1e-5)
    nodes = json.loads((out / "nodes.json").read_text())["nodes"]
    assert len(nodes) == expected.adjacency.shape[0] and nodes[0]["kind"] == "feature"
    frontend = json.loads((out / "graph.json").read_text())
    ids = {node["node_id"] for node in frontend["nodes"]}
    assert frontend["metadata"]["prompt"] == PROMPT and len(ids) == len(frontend["nodes"]) > 10
    assert all(link["source"] in ids and link["target"] in ids for link in frontend["links"])
    assert frontend["metadata"]["prompt_tokens"] == [tokenizer.decode([t]) for t in expected.input_tokens.tolist()]
    (run,) = (out / "tensorboard").iterdir() if (out / "tensorboard").is_dir() and any(
        p.is_dir() for p in (out / "tensorboard").iterdir()) else [out / "tensorboard"]
    events = EventAccumulator(str(run), size_guidance={"tensors": 0, "images": 0})
    events.Reload()
    texts = {tag: events.Tensors(tag)[0].tensor_proto.string_val[0].decode() for tag in events.Tags()["tensors"]
             if tag.endswith("text_summary")}
    assert {"circuit/summary/text_summary", "circuit/top_nodes/text_summary", "circuit/top_edges/text_summary",
            "circuit/intervention/text_summary"} <= set(texts)
    top = max(frontend["nodes"], key=lambda n: -(n["influence"] if n["influence"] is not None else 2))
    assert node_label(top, frontend["metadata"]["prompt_tokens"]) in texts["circuit/top_nodes/text_summary"]
    assert '"pruned_nodes": %d' % len(frontend["nodes"]) in texts["circuit/summary/text_summary"]
    assert events.Tags()["images"] == ["circuit/feature_influence"]


class _Page(HTMLParser):
    """The tags, attributes and text of a page."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.text: list[str] = []
        self.open: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))
        if tag not in ("meta", "br", "img", "input", "link"):  # void elements have no end tag
            self.open.append(tag)

    def handle_endtag(self, tag: str) -> None:
        assert self.open and self.open[-1] == tag, (tag, self.open[-5:])
        self.open.pop()

    def handle_data(self, data: str) -> None:
        self.text.append(data)


def _expected_labels(out: Path) -> dict[str, str]:
    frontend = json.loads((out / "graph.json").read_text())
    return {n["node_id"]: node_label(n, frontend["metadata"]["prompt_tokens"]) for n in frontend["nodes"]}


def test_graph_html_is_self_contained_and_names_every_node(saved: dict[str, Path]) -> None:
    page = (saved["out"] / "graph.html").read_text()
    assert not re.search(r"https?://|//cdn|<link|\bsrc=|@import|url\(", page)  # nothing fetched
    parser = _Page()
    parser.feed(page.split("<!DOCTYPE html>", 1)[1])
    parser.close()
    assert parser.open == []  # every element closed, in order
    labels = _expected_labels(saved["out"])
    circles = [attrs["data-node"] for tag, attrs in parser.tags if tag == "circle"]
    assert sorted(circles) == sorted(labels)
    lines = [(a["data-source"], a["data-target"]) for tag, a in parser.tags if tag == "line"]
    frontend = json.loads((saved["out"] / "graph.json").read_text())
    assert sorted(lines) == sorted((k["source"], k["target"]) for k in frontend["links"])
    text = "".join(parser.text)
    assert all(label in text for label in labels.values())
    assert any(re.fullmatch(r'L[01] F\d+ @\d+ ".+"', label) for label in labels.values())


def _browser() -> str | None:
    """A headless Chromium: $GRADPATCH_BROWSER, else chromium-headless-shell or chromium on the PATH."""
    found = os.environ.get("GRADPATCH_BROWSER") or shutil.which("chromium-headless-shell") or shutil.which("chromium")
    return found if found and Path(found).exists() else None


@pytest.mark.browser
@pytest.mark.skipif(_browser() is None, reason="no headless browser (set GRADPATCH_BROWSER or install chromium)")
def test_graph_html_shows_every_node_in_a_headless_browser(saved: dict[str, Path]) -> None:
    """The DOM after the page's script ran (``--dump-dom``) holds every node and its label; clicking a node
    (the page's script, run by the browser) highlights exactly its links."""
    page = saved["out"] / "graph.html"
    first = json.loads((saved["out"] / "graph.json").read_text())["links"][0]
    probe = page.with_name("probe.html")
    probe.write_text(page.read_text().replace("</body>", f"<script>pick({json.dumps(first['source'])});</script>"
                                                          "</body>"))
    try:
        dom = subprocess.run([_browser(), "--headless", "--no-sandbox", "--disable-gpu", "--dump-dom",
                              probe.as_uri()], capture_output=True, text=True, timeout=120, check=True).stdout
    finally:
        probe.unlink()
    parser = _Page()
    parser.feed(dom)
    labels = _expected_labels(saved["out"])
    shown = {a["data-node"] for tag, a in parser.tags if tag == "circle"}
    assert shown == set(labels)
    text = "".join(parser.text)
    assert all(label in text for label in labels.values())
    highlighted = [a for tag, a in parser.tags if tag == "line" and "hi" in (a.get("class") or "").split()]
    assert highlighted and all(first["source"] in (a["data-source"], a["data-target"]) for a in highlighted)


def test_circuit_tracer_layout_gives_the_same_graph(saved: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "ct"
    assert cli.main(["circuit", "--prompt", PROMPT, "--dictionaries", str(saved["circuit_tracer"]),
                     "--model", str(saved["model"]), "--device", "cpu", "--out", str(out)]) == 0
    torch.testing.assert_close(load_file(out / "adjacency.safetensors")["adjacency"],
                               load_file(saved["out"] / "adjacency.safetensors")["adjacency"], rtol=1e-4, atol=1e-5)
    assert not (out / "interventions.json").exists()
