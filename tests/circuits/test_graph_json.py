"""graph.json (gradpatch.circuits.save_graph / frontend_graph) of a real small graph (the tiny Llama with random
skip transcoders): it passes Neuronpedia's graph schema, its features are encoded as circuit-tracer 0.5.0 encodes
them (Cantor pairs, schema_version 1), every node id reads back to its (layer, position, feature) under
circuit-tracer's decode_url_features rules (written out here), its slug is unique per graph, and it holds no NaN."""

from __future__ import annotations

import dataclasses
import datetime
import json
import re
from pathlib import Path

import jsonschema
import pytest
import torch
from test_circuits import tiny_replacement

from gradpatch.circuits import (AttributionGraph, CircuitError, attribute, cantor_unpair, frontend_graph, graph_slug,
                                node_records, parse_node_id, save_graph)

SCHEMA = json.loads((Path(__file__).with_name("neuronpedia_graph_schema.json")).read_text())
NAME = re.compile(r"[a-zA-Z0-9_.-]+")  # Neuronpedia's save-to-db check of slug and scan
WHEN = datetime.datetime(2026, 11, 29, 1, 2, 3, tzinfo=datetime.timezone.utc)


@pytest.fixture(scope="module")
def graph() -> AttributionGraph:
    prompt = torch.randint(0, 100, (1, 7), generator=torch.Generator().manual_seed(3))
    return attribute(tiny_replacement("llama", prompt), batch_size=32, zero_first_position=False)


def _pinned(node_id: str) -> tuple[int, int, int] | None:
    """circuit-tracer's decode_url_features on one pinned id: ``E_{t}_{p}`` -> (-1, p, t), ``{a}_{b}_{c}`` ->
    (a, c, b), any other id dropped (``None``)."""
    if node_id.startswith("E_"):
        parts = node_id[2:].split("_")
        return (-1, int(parts[1]), int(parts[0])) if len(parts) == 2 else None
    parts = node_id.split("_")
    return (int(parts[0]), int(parts[2]), int(parts[1])) if len(parts) == 3 else None


def _supernode(node_id: str) -> tuple[int, int, int]:
    """circuit-tracer's decode_url_features on one supernode member: ``layer, feature, pos = map(int, split("_"))``."""
    layer, feature, position = map(int, node_id.split("_"))
    return layer, position, feature


def test_graph_json_passes_neuronpedias_schema(graph: AttributionGraph, tmp_path: Path) -> None:
    save_graph(graph, tmp_path, prompt="the prompt", scan="tiny-llama", node_threshold=1.0, edge_threshold=1.0)
    document = json.loads((tmp_path / "graph.json").read_text())
    errors = sorted(jsonschema.Draft7Validator(SCHEMA).iter_errors(document), key=str)
    assert errors == []
    metadata = document["metadata"]
    assert metadata["schema_version"] == 1 and metadata["scan"] == "tiny-llama"
    assert NAME.fullmatch(metadata["slug"]) and NAME.fullmatch(metadata["scan"])
    assert metadata["pruning_settings"] == {"node_threshold": 1.0, "edge_threshold": 1.0}
    assert len(document["nodes"]) > graph.n_features // 2 and document["links"]
    broken = dict(document, nodes=[{k: v for k, v in node.items() if k != "clerp"} for node in document["nodes"]])
    assert any(jsonschema.Draft7Validator(SCHEMA).iter_errors(broken))  # the check can fail


def test_every_node_id_reads_back_to_its_layer_position_and_feature(graph: AttributionGraph) -> None:
    frontend = frontend_graph(graph, node_threshold=1.0, edge_threshold=1.0, scan="tiny-llama", created=WHEN)
    records = node_records(graph)
    expected = {"cross layer transcoder": {(r["layer"], r["position"], r["feature"]) for r in records
                                           if r["kind"] == "feature"},
                "mlp reconstruction error": {(r["layer"], r["position"], -1) for r in records if r["kind"] == "error"},
                "embedding": {(-1, r["position"], r["feature"]) for r in records if r["kind"] == "token"},
                "logit": {(max(graph.layers) + 2, r["position"], r["feature"]) for r in records
                          if r["kind"] == "logit"}}
    ids = [node["node_id"] for node in frontend["nodes"]]
    assert len(ids) == len(set(ids))
    js = {kind: {node["jsNodeId"] for node in frontend["nodes"] if node["feature_type"] == kind} for kind in expected}
    assert not js["cross layer transcoder"] & js["mlp reconstruction error"]  # a feature's jsNodeId spans positions
    seen = {kind: 0 for kind in expected}
    for node in frontend["nodes"]:
        decoded = _pinned(node["node_id"])
        assert decoded in expected[node["feature_type"]], node
        assert parse_node_id(node["node_id"]) == decoded and decoded[1] == node["ctx_idx"]
        if node["feature_type"] != "embedding":
            assert _supernode(node["node_id"]) == decoded
        if node["feature_type"] == "cross layer transcoder":  # 0.5.0's Node.feature_node: a Cantor pair
            assert cantor_unpair(node["feature"]) == (decoded[0], decoded[2]) and node["layer"] == str(decoded[0])
        seen[node["feature_type"]] += 1
    assert all(seen.values()), seen  # every kind of node was read back
    assert {link["source"] for link in frontend["links"]} | {link["target"] for link in frontend["links"]} <= set(ids)


def test_the_slug_is_unique_per_graph_and_the_caller_may_name_it(graph: AttributionGraph) -> None:
    slug = graph_slug("tiny-llama", "the prompt", WHEN)
    assert NAME.fullmatch(slug) and slug.startswith("tiny-llama-20261129-010203-")
    assert graph_slug("tiny-llama", "the prompt", WHEN) == slug
    assert graph_slug("tiny-llama", "another prompt", WHEN) != slug
    assert graph_slug("tiny-llama", "the prompt", WHEN + datetime.timedelta(seconds=1)) != slug
    assert NAME.fullmatch(graph_slug("my model/v2 (é)", "p", WHEN))
    made = frontend_graph(graph, prompt="the prompt", scan="tiny-llama", created=WHEN)
    assert made["metadata"]["slug"] == slug and made["metadata"]["info"]["create_time_ms"] == 1795914123000
    assert frontend_graph(graph, slug="my-graph.1")["metadata"]["slug"] == "my-graph.1"
    for bad in ({"slug": "my graph"}, {"scan": "a/b"}):
        with pytest.raises(CircuitError, match="characters Neuronpedia refuses"):
            frontend_graph(graph, **bad)


def test_no_nan_or_infinity_is_written(graph: AttributionGraph, tmp_path: Path) -> None:
    save_graph(graph, tmp_path / "good", node_threshold=1.0, edge_threshold=1.0)
    for name in ("graph.json", "nodes.json"):
        json.loads((tmp_path / "good" / name).read_text(), parse_constant=lambda constant: pytest.fail(constant))
    diverged = dataclasses.replace(graph, activations=torch.full_like(graph.activations, float("nan")))
    with pytest.raises(CircuitError, match=r"graph.json cannot hold NaN or ±inf, but \d+ values are \(node "
                                           r"\d+_\d+_\d+ activation.*check the transcoders"):
        save_graph(diverged, tmp_path / "bad", node_threshold=1.0, edge_threshold=1.0)
    assert not (tmp_path / "bad").exists()  # refused before anything is written
