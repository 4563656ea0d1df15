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
                                intervene_direct, node_label)
from gradpatch.dictionaries import SkipTranscoder, export_circuit_tracer, save_dictionary
from gradpatch.files.loaders import load_model
from gradpatch.patches import AddPatch
from recipes import cli
from gradpatch.circuits import with_special_first
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


def _replacement(saved: dict[str, Path], keep_first_position: bool = False) -> tuple[ReplacementModel, object]:
    """The CLI's replacement model: a special token prepended to the prompt unless ``keep_first_position``."""
    model, tokenizer = load_model(saved["model"])
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    ids = ids if keep_first_position else with_special_first(ids, tokenizer)
    return ReplacementModel(PatchableGraph(model, ids, use_cache=False), _transcoders(), ids), tokenizer


def test_circuit_writes_the_graph_html_and_tensorboard(saved: dict[str, Path]) -> None:
    out = saved["out"]
    assert {p.name for p in out.iterdir()} == {"adjacency.safetensors", "nodes.json", "graph.json", "graph.html",
                                               "interventions.json", "tensorboard", "provenance.json",
                                               "attribution.json"}
    replacement, tokenizer = _replacement(saved)
    expected = attribute(replacement)
    tensors = load_file(out / "adjacency.safetensors")
    torch.testing.assert_close(tensors["rows"], expected.rows, rtol=1e-4, atol=1e-5)
    assert torch.equal(tensors["row_nodes"], expected.target_nodes)
    nodes = json.loads((out / "nodes.json").read_text())["nodes"]
    assert len(nodes) == expected.n_nodes and nodes[0]["kind"] == "feature"
    frontend = json.loads((out / "graph.json").read_text())
    ids = {node["node_id"] for node in frontend["nodes"]}
    assert frontend["metadata"]["prompt"] == PROMPT and len(ids) == len(frontend["nodes"]) > 10
    assert all(link["source"] in ids and link["target"] in ids for link in frontend["links"])
    assert frontend["metadata"]["prompt_tokens"] == [tokenizer.decode([t]) for t in expected.input_tokens.tolist()]
    events = EventAccumulator(str(out / "tensorboard"), size_guidance={"tensors": 0, "images": 0})
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


def test_position_zero_follows_circuit_tracer_unless_kept(saved: dict[str, Path], tmp_path: Path) -> None:
    """By default a special token is prepended (the tiny tokenizer adds none, and has no BOS: its pad token) and
    position 0 has no feature node; ``--keep-first-position`` runs the prompt as tokenized, with position 0's
    nodes (the graph :func:`attribute` gives with ``zero_first_position=False``)."""
    model, tokenizer = load_model(saved["model"])
    raw = tokenizer(PROMPT, return_tensors="pt").input_ids
    assert int(raw[0, 0]) not in tokenizer.all_special_ids
    assert with_special_first(raw, tokenizer).tolist() == [[tokenizer.pad_token_id, *raw[0].tolist()]]
    assert torch.equal(with_special_first(with_special_first(raw, tokenizer), tokenizer),
                       with_special_first(raw, tokenizer))
    nodes = json.loads((saved["out"] / "nodes.json").read_text())["nodes"]
    assert all(n["position"] >= 1 for n in nodes if n["kind"] == "feature")
    assert len([n for n in nodes if n["kind"] == "token"]) == raw.shape[1] + 1
    out = tmp_path / "kept"
    assert cli.main(["circuit", "--prompt", PROMPT, "--dictionaries", str(saved["dictionaries"]), "--model",
                     str(saved["model"]), "--device", "cpu", "--batch-size", "64", "--out", str(out),
                     "--keep-first-position"]) == 0
    replacement, _ = _replacement(saved, keep_first_position=True)
    expected = attribute(replacement, zero_first_position=False)
    assert int((expected.active_features[:, 1] == 0).sum()) > 0
    torch.testing.assert_close(load_file(out / "adjacency.safetensors")["rows"], expected.rows, rtol=1e-4, atol=1e-5)


def test_circuit_tracer_layout_gives_the_same_graph(saved: dict[str, Path], tmp_path: Path) -> None:
    """The config.yaml layout gives the same graph; ``--direct-effects`` runs the edit in the frozen model."""
    out = tmp_path / "ct"
    assert cli.main(["circuit", "--prompt", PROMPT, "--dictionaries", str(saved["circuit_tracer"]),
                     "--model", str(saved["model"]), "--device", "cpu", "--out", str(out), "--direct-effects",
                     "--intervene", "clamp:1:-1:3=2.0"]) == 0
    torch.testing.assert_close(load_file(out / "adjacency.safetensors")["rows"],
                               load_file(saved["out"] / "adjacency.safetensors")["rows"], rtol=1e-4, atol=1e-5)
    replacement, _ = _replacement(saved)
    expected = intervene_direct(replacement, [FeatureEdit(1, -1, 3, "clamp", 2.0)])
    record = json.loads((out / "interventions.json").read_text())
    assert [t["token"] for t in record["top_after"]] == [token for token, _ in expected.top_after]
    assert [t["probability"] for t in record["top_after"]] == pytest.approx([p for _, p in expected.top_after])


@pytest.fixture(scope="module")
def tiny(saved: dict[str, Path]) -> tuple[PatchableGraph, dict[int, SkipTranscoder], torch.Tensor]:
    model, tokenizer = load_model(saved["model"])
    ids = with_special_first(tokenizer(PROMPT, return_tensors="pt").input_ids, tokenizer)  # as the CLI runs it
    return PatchableGraph(model, ids, use_cache=False), _transcoders(), ids


def test_intervention_without_edits_or_on_an_inactive_feature_changes_nothing(tiny) -> None:
    pg, transcoders, ids = tiny
    with torch.no_grad():
        original = pg(ids).logits
    for freeze in (True, False):
        result = intervene(pg, transcoders, ids, [], freeze_attention=freeze)
        assert torch.equal(result.logits_before, original) and torch.equal(result.logits_after, original)
    latents = transcoders[1].encode(_mlp_input(pg, ids, 1))[0, 4]
    inactive = int((latents == 0).nonzero()[0])
    result = intervene(pg, transcoders, ids, [FeatureEdit(1, 4, inactive, "ablate")])
    assert result.activations == [0.0] and torch.equal(result.logits_after, original)


def _mlp_input(pg: PatchableGraph, ids: torch.Tensor, layer: int) -> torch.Tensor:
    from gradpatch.patches import ProbePatch

    probe = ProbePatch()
    with torch.no_grad(), pg.patch({f"model.layers_{layer}.mlp.x": [probe]}):
        pg(ids)
    return probe.activation


def test_an_edit_changes_nothing_before_its_position(tiny) -> None:
    pg, transcoders, ids = tiny
    latents = transcoders[0].encode(_mlp_input(pg, ids, 0))[0]
    position = 5
    active = latents[position].topk(3).indices.tolist()
    edits = [FeatureEdit(0, position, active[0], "ablate"), FeatureEdit(0, position, active[1], "clamp", 4.0),
             FeatureEdit(0, position, active[2], "scale", 3.0), FeatureEdit(1, position, 9, "steer", -2.0)]
    results = {freeze: intervene(pg, transcoders, ids, edits, freeze_attention=freeze) for freeze in (True, False)}
    for result in results.values():
        assert torch.equal(result.logits_after[:, :position], result.logits_before[:, :position])
        assert (result.logits_after[:, position:] - result.logits_before[:, position:]).abs().amax(-1).min() > 1e-4
        assert result.activations[:3] == pytest.approx(latents[position, active].tolist(), rel=1e-5)
    frozen, live = results[True].logits_after, results[False].logits_after
    assert not torch.allclose(frozen[:, position:], live[:, position:])  # live patterns respond to the edit


def test_steering_equals_adding_the_decoder_row(tiny) -> None:
    """steer α at (layer, position, feature) = an AddPatch of α · W_dec[feature] at the MLP output there."""
    pg, transcoders, ids = tiny
    alpha, feature, position = 2.5, 7, -1
    result = intervene(pg, transcoders, ids, [FeatureEdit(1, position, feature, "steer", alpha)],
                       freeze_attention=False)
    vector = alpha * transcoders[1].W_dec[feature].detach()
    with torch.no_grad(), pg.patch({"model.layers_1.mlp.output": [AddPatch(value=vector,
                                                                            slice=(slice(None), position))]}):
        manual = pg(ids).logits
    torch.testing.assert_close(result.logits_after, manual, rtol=1e-6, atol=1e-6)
    assert not torch.allclose(manual, result.logits_before)


def test_direct_effects_change_a_logit_by_its_graph_edges(saved: dict[str, Path]) -> None:
    """In the frozen replacement model, ablating feature s changes logit target t by −A[t, s]; clamping it to 3 a_s
    by +2 A[t, s]; ablating two features by the sum of their edges (within 1e-3 of the change)."""
    replacement, _ = _replacement(saved)
    graph = attribute(replacement, batch_size=64)
    row = graph.logit_start
    token = int(graph.logit_tokens[0])
    sources = graph.adjacency[row, :graph.n_features].abs().topk(2).indices.tolist()
    edits = [FeatureEdit(*graph.active_features[s].tolist(), "ablate") for s in sources]

    def change(result) -> float:
        shift = result.logits_after[0, -1] - result.logits_before[0, -1]
        return float(shift[token] - shift.mean())

    edge = float(graph.adjacency[row, sources[0]])
    assert torch.equal(intervene_direct(replacement, []).logits_after, replacement.logits)
    assert change(intervene_direct(replacement, edits[:1])) == pytest.approx(-edge, rel=1e-3)
    layer, position, feature = graph.active_features[sources[0]].tolist()
    clamp = FeatureEdit(layer, position, feature, "clamp", 3 * float(graph.activations[sources[0]]))
    assert change(intervene_direct(replacement, [clamp])) == pytest.approx(2 * edge, rel=1e-3)
    both = float(graph.adjacency[row, sources].sum())
    result = intervene_direct(replacement, edits)
    assert change(result) == pytest.approx(-both, rel=1e-3)
    assert result.activations == pytest.approx(graph.activations[sources].tolist())
    with pytest.raises(CircuitError, match="feature 64 is outside 0..63"):
        intervene_direct(replacement, [FeatureEdit(0, 0, 64)])


def test_cli_interventions_json_matches_intervene(saved: dict[str, Path], tiny) -> None:
    pg, transcoders, ids = tiny
    record = json.loads((saved["out"] / "interventions.json").read_text())
    result = intervene(pg, transcoders, ids, [FeatureEdit(0, 3, 5, "ablate"), FeatureEdit(1, -1, 7, "steer", 2.5)])
    assert [(e["kind"], e["layer"], e["position"], e["feature"], e["value"]) for e in record["edits"]] == [
        ("ablate", 0, 3, 5, 0.0), ("steer", 1, -1, 7, 2.5)]
    for side in ("top_before", "top_after"):
        assert [t["token"] for t in record[side]] == [token for token, _ in getattr(result, side)]
        assert [t["probability"] for t in record[side]] == pytest.approx([p for _, p in getattr(result, side)])
    assert record["top_before"] != record["top_after"]


def test_max_feature_nodes_keeps_the_features_circuit_tracer_visits(saved: dict[str, Path], tmp_path: Path) -> None:
    """``attribute(max_feature_nodes=N)`` computes the rows of the N features circuit-tracer visits, and the graph
    keeps them: the full graph's rows and columns of those nodes (tests/circuits/test_circuits_scale.py replays the
    rounds on the full graph)."""
    replacement, _ = _replacement(saved)
    graph = attribute(replacement, batch_size=64, max_feature_nodes=None)
    assert graph.total_features == graph.n_features
    # one round (4 · batch_size ≥ N): circuit-tracer ranks the features by influence through the logit rows alone
    absolute = graph.rows[graph.n_features:].abs()
    direct = (graph.logit_probabilities @ (absolute / absolute.sum(1, keepdim=True).clamp(min=1e-10)))[
        :graph.n_features]
    one_round = attribute(replacement, batch_size=8, max_feature_nodes=20)
    assert one_round.total_features == graph.n_features and one_round.n_features == 20
    assert torch.equal(one_round.active_features, graph.active_features[torch.sort(direct.topk(20).indices).values])
    # several rounds: later ranks use the rows of the features visited so far; the first round's are the top 8
    small = attribute(replacement, batch_size=2, max_feature_nodes=30)
    chosen = [graph.active_features.tolist().index(f) for f in small.active_features.tolist()]
    assert len(chosen) == 30 and set(direct.topk(8).indices.tolist()) <= set(chosen)
    kept = torch.tensor(chosen)
    keep = torch.cat([kept, torch.arange(graph.n_features, graph.n_nodes)])
    torch.testing.assert_close(small.adjacency, graph.adjacency[keep][:, keep], rtol=1e-5, atol=1e-6)
    assert small.logit_start == len(keep) - len(graph.logit_tokens)
    out = tmp_path / "small"
    assert cli.main(["circuit", "--prompt", PROMPT, "--dictionaries", str(saved["dictionaries"]),
                     "--model", str(saved["model"]), "--device", "cpu", "--max-feature-nodes", "30",
                     "--batch-size", "2", "--out", str(out)]) == 0
    nodes = json.loads((out / "nodes.json").read_text())["nodes"]
    assert [[n["layer"], n["position"], n["feature"]] for n in nodes if n["kind"] == "feature"] == \
        small.active_features.tolist()


def test_transcoder_nodes_off_the_path_from_embeddings_to_logits_are_refused(tiny) -> None:
    pg, transcoders, ids = tiny
    from gradpatch.dictionaries import Transcoder

    rotary = Transcoder(16, 32, 64, activation="relu", input_node="model.rotary_emb.cos",
                        output_node="model.layers_0.mlp.output")  # cos: computed from the positions alone
    with pytest.raises(NoPathError, match="input node 'model.rotary_emb.cos' does not depend on the token embeddings"):
        ReplacementModel(pg, {0: rotary, 1: transcoders[1]}, ids)
    unused = Transcoder(64, 32, activation="relu", input_node="model.embed_tokens.output",
                        output_node="model.rotary_emb.x")  # read by the rotary embedding for its dtype alone
    with pytest.raises(NoPathError, match="output node 'model.rotary_emb.x' lies on no path to the logits"):
        ReplacementModel(pg, {0: unused}, ids)
    with pytest.raises(CircuitError, match="no transcoder at layer 3; the transcoders are at layers"):
        intervene(pg, transcoders, ids, [FeatureEdit(3, 0, 1)])
    with pytest.raises(CircuitError, match="position 40 is outside the prompt"):
        intervene(pg, transcoders, ids, [FeatureEdit(0, 40, 1)])


@pytest.mark.parametrize("case", ["missing", "layout", "fingerprint", "context", "syntax", "value", "layer",
                                  "feature", "threshold", "no_path"])
def test_bad_input_exits_with_status_2_and_writes_nothing(saved: dict[str, Path], tmp_path: Path, case: str,
                                                         capsys: pytest.CaptureFixture) -> None:
    dictionaries, prompt, extra = saved["dictionaries"], PROMPT, []
    if case == "missing":
        dictionaries = tmp_path / "nothing"
    elif case == "layout":
        dictionaries = tmp_path / "empty"
        dictionaries.mkdir()
    elif case == "fingerprint":
        other, _ = load_model(save_tiny_backbone(tmp_path / "other", seed=1))
        dictionaries = tmp_path / "other_dictionaries"
        for layer, transcoder in _transcoders().items():
            save_dictionary(transcoder, dictionaries / f"layer_{layer}", model=other)
    elif case == "context":
        prompt = " ".join(["the city"] * 70)  # 140 tokens > 128
    elif case == "syntax":
        extra = ["--intervene", "ablate:0:1"]
    elif case == "value":
        extra = ["--intervene", "clamp:0:1:2"]
    elif case == "layer":
        extra = ["--intervene", "ablate:4:1:2"]
    elif case == "feature":
        extra = ["--intervene", "ablate:0:1:99"]
    elif case == "threshold":
        extra = ["--node-threshold", "1.5"]
    else:
        from gradpatch.dictionaries import Transcoder

        dictionaries = tmp_path / "rotary"
        save_dictionary(Transcoder(16, 32, 64, activation="relu", input_node="model.rotary_emb.cos",
                                   output_node="model.layers_0.mlp.output"), dictionaries / "layer_0")
    out = tmp_path / "out"
    assert cli.main(["circuit", "--prompt", prompt, "--dictionaries", str(dictionaries), "--model",
                     str(saved["model"]), "--device", "cpu", "--out", str(out), *extra]) == 2
    expected = {"missing": "is not a folder", "layout": "neither layer_<i>/ folders", "fingerprint": "fingerprint",
                "context": "more than the model's context of 128", "syntax": "KIND:LAYER:POSITION:FEATURE",
                "value": "clamp takes a =VALUE", "layer": "no transcoder at layer 4", "feature": "outside 0..63",
                "threshold": "--node-threshold 1.5", "no_path": "does not depend on the token embeddings"}[case]
    assert expected in capsys.readouterr().err
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".out.")]


def test_an_earlier_run_is_refused_then_replaced_whole_with_provenance(saved: dict[str, Path], tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture) -> None:
    """An --out holding an earlier run (with interventions.json) is refused, naming --overwrite, and left as it was;
    with --overwrite it is replaced whole: no interventions.json of the earlier run beside the new graph, every JSON
    file records the prompt, the dictionaries, the command line and the versions, provenance.json lists every file,
    the folder has the user's umask, and a progress bar counts the steps on stderr (none with --quiet)."""
    out = tmp_path / "run"
    shutil.copytree(saved["out"], out)
    before = sorted(path.name for path in out.iterdir())
    prompt = "the capital of Italy is"
    args = ["circuit", "--prompt", prompt, "--dictionaries", str(saved["dictionaries"]), "--model",
            str(saved["model"]), "--device", "cpu", "--batch-size", "64", "--out", str(out)]
    assert cli.main(args) == 2
    assert f"--out {out} holds an earlier run; give --overwrite" in capsys.readouterr().err
    assert sorted(path.name for path in out.iterdir()) == before
    mask = os.umask(0o022)
    try:
        assert cli.main([*args, "--overwrite"]) == 0
    finally:
        os.umask(mask)
    err = capsys.readouterr().err
    assert "circuit: 100%" in err and "3/3" in err
    assert {path.name for path in out.iterdir()} == {"adjacency.safetensors", "nodes.json", "graph.json", "graph.html",
                                                     "tensorboard", "provenance.json", "attribution.json"}
    assert out.stat().st_mode & 0o777 == 0o755 and sorted(path.name for path in tmp_path.iterdir()) == ["run"]
    from importlib.metadata import version

    for name in ("nodes.json", "graph.json"):
        record = json.loads((out / name).read_text())["provenance"]
        assert record["command"] == ["gradpatch", *args, "--overwrite"]
        assert (record["arguments"]["prompt"], record["arguments"]["dictionaries"]) == ([prompt],
                                                                                         str(saved["dictionaries"]))
        assert all(record["versions"][name] == version(name) for name in ("gradpatch", "torch", "transformers"))
    assert json.loads((out / "graph.json").read_text())["metadata"]["prompt"] == prompt
    listing = json.loads((out / "provenance.json").read_text())
    assert set(listing["files"]) == {path.relative_to(out).as_posix() for path in out.rglob("*")
                                     if path.is_file() and path.name != "provenance.json"}
    assert cli.main([*args, "--overwrite", "--quiet"]) == 0
    assert "circuit:" not in capsys.readouterr().err


def test_qk_head_loadings_and_annotations_through_the_command(saved: dict[str, Path], tmp_path: Path) -> None:
    """``--qk`` and ``--head-loadings`` write their files beside the graph, whose graph.json carries the scores and
    each feature's top logits (what graph.html shows), and the QK terms sum to the score they decompose."""
    out = tmp_path / "qk"
    assert cli.main(["circuit", "--prompt", PROMPT, "--dictionaries", str(saved["dictionaries"]), "--model",
                     str(saved["model"]), "--device", "cpu", "--out", str(out), "--qk", "0@1:-1", "--qk-keys", "2",
                     "--head-loadings", "--head-loading-sources", "2", "--quiet"]) == 0
    names = {p.name for p in out.iterdir()}
    assert {"qk.json", "head_loadings.safetensors", "head_loadings.json", "graph.json"} <= names
    frontend = json.loads((out / "graph.json").read_text())
    scores = frontend["metadata"]["scores"]
    summary = json.loads((out / "attribution.json").read_text())
    assert scores["replacement_score"] == summary["replacement_score"]
    assert summary["live_mlp_layers"] == []
    features = [n for n in frontend["nodes"] if n["feature_type"] == "cross layer transcoder"]
    assert features and all(len(n["top_logits"]) > 0 for n in features)
    qk = json.loads((out / "qk.json").read_text())
    assert qk["scores"] and all(s["layer"] == 1 and s["head"] == 0 for s in qk["scores"])
