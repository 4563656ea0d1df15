"""QK attributions and head loadings over a cross-layer transcoder (CLT), on a tiny three-layer Llama (eager
attention, so that a test reads the live query) with a random ReLU CLT with skip terms over its three MLPs: a
feature's query- and key-side parts include its decoder blocks into every later MLP output (a layer-0 feature's
part of a layer-2 score goes through its layer-0 and layer-1 blocks); the terms sum to the pre-softmax score within
1e-4 relative and sampled terms equal perturbations of the frozen model within 1e-3; the head loadings sum to each
edge within 1e-5 relative (circuit-tracer PR 114's check, tests/circuits/test_head_loadings.py) and match
perturbations; and ``gradpatch circuit --dictionaries <CLT folder> --qk ... --head-loadings``."""

from __future__ import annotations

import json

import pytest
import torch
from test_head_loadings import _assert_split_is_measured, _check_sums
from test_qk import prompt

from gradpatch import PatchableGraph, testing
from gradpatch.circuits import AttributionGraph, ReplacementModel, attribute
from gradpatch.circuits.attention import find_attention_sites
from gradpatch.circuits.clt_layers import CLTLayerView
from gradpatch.circuits.heads import head_loadings
from gradpatch.circuits.qk import BIAS, check_qk_term, qk_attributions
from gradpatch.circuits.sources import source_deltas
from gradpatch.dictionaries import CLTConfig, CrossLayerTranscoder, save_clt
from gradpatch.patches import HoldPatch

LAYERS = 3


def _clt(layers: int, read: str = "model.layers_{}.mlp.x", write: str = "model.layers_{}.mlp.output",
         d_model: int = 64) -> CrossLayerTranscoder:
    """A random ReLU CLT with skip terms over ``layers`` MLPs (64 latents per layer; b_enc > 0 on average so that
    features fire)."""
    generator = torch.Generator().manual_seed(0)
    config = CLTConfig(activation="relu", n_layers=layers, d_in=d_model, d_sae=64, skip=True,
                       input_nodes=[read.format(layer) for layer in range(layers)],
                       output_nodes=[write.format(layer) for layer in range(layers)])
    clt = CrossLayerTranscoder(config, generator=generator)
    with torch.no_grad():
        clt.b_enc.normal_(0.02, 0.05, generator=generator)
        clt.b_dec.normal_(0, 0.01, generator=generator)
        clt.W_skip.normal_(0, 0.05, generator=generator)
    return clt


@pytest.fixture(scope="module")
def built() -> tuple[ReplacementModel, AttributionGraph]:
    model = testing.tiny_causal_lm("llama", hidden=64, layers=LAYERS)
    model.config._attn_implementation = "eager"
    ids = prompt()
    pg = PatchableGraph(model, ids, use_cache=False)
    replacement = ReplacementModel(pg, _clt(LAYERS), ids)
    return replacement, attribute(replacement, batch_size=64)


def test_qk_terms_sum_to_the_score_and_match_perturbations(built) -> None:
    model, graph = built
    assert isinstance(model.layers[0].transcoder, CLTLayerView) and graph.layers == [0, 1, 2]
    for attribution in qk_attributions(model, graph, [(2, 0, 6, 2), (2, 3, 6, 6), (1, 1, 5, 1)], batch_size=64):
        missed, size = attribution.reconstruction()
        assert missed <= 1e-4 * abs(attribution.score) + 1e-7 * size
        sampled = [t for t in attribution.top_terms(6) if BIAS not in (t.query_node, t.key_node)][:3]
        assert sampled
        for term in sampled:
            check = check_qk_term(model, graph, attribution, term.query_node, term.key_node, epsilon=0.5)
            assert check.measured_term == pytest.approx(check.term, rel=1e-3, abs=1e-6 * size)
            assert check.measured_row == pytest.approx(check.row, rel=1e-3, abs=1e-6 * size)


def _query_change(model: ReplacementModel, layer: int, head: int, position: int,
                  deltas: dict[int, torch.Tensor]) -> torch.Tensor:
    """Δq ``[head_dim]`` of ``head`` at ``position`` of attention layer ``layer`` when the MLP outputs move by
    ``deltas`` (one row each), in the frozen model (eager attention: the query is live, the pattern frozen)."""
    site = find_attention_sites(model.pg)[layer]
    reader = HoldPatch()
    rows = {written: torch.cat([torch.zeros_like(delta), delta]) for written, delta in deltas.items()}
    with torch.no_grad():
        model.run(2, rows, patches={site.query: [reader]})
    query = reader.held[:, head, position].double()
    return query[1] - query[0]


def test_a_layer_0_features_query_part_goes_through_its_later_decoder_blocks(built) -> None:
    """The query part q_s of a layer-0 feature in a layer-2 score is what its decoder blocks into MLPs 0 and 1
    write, together: moving the feature through its layer-0 block alone misses it by its layer-1 block's share."""
    model, graph = built
    (attribution,) = qk_attributions(model, graph, [(2, 1, 6, 3)])
    layer_0 = [i for i, node in enumerate(attribution.query_nodes.tolist())
               if node < graph.n_features and int(graph.active_features[node, 0]) == 0]
    index = max(layer_0, key=lambda i: float(attribution.query_parts[i].norm()))
    node = int(attribution.query_nodes[index])
    part = attribution.query_parts[index].double()
    deltas, _ = source_deltas(model, graph, [{node: 1.0}])
    whole = _query_change(model, 2, 1, 6, deltas)
    first = _query_change(model, 2, 1, 6, {0: deltas[0]})
    second = _query_change(model, 2, 1, 6, {1: deltas[1]})
    assert float((whole - part).norm()) <= 1e-4 * float(part.norm())
    assert float(second.norm()) > 1e-2 * float(part.norm())
    assert float((first - part).norm()) > 1e-2 * float(part.norm())
    assert float((first + second - part).norm()) <= 1e-4 * float(part.norm())


def test_head_loadings_sum_to_each_edge_and_match_perturbations(built) -> None:
    model, graph = built
    targets = [graph.logit_start, graph.logit_start + 1, graph.n_features - 1]
    loadings = head_loadings(model, graph, targets)
    checked, pr114 = _check_sums(graph, loadings)
    assert checked > 100 and pr114 > 50 and len(loadings.heads) == LAYERS
    layer_0 = [n for n in range(graph.n_features) if int(graph.active_features[n, 0]) == 0]
    source = max(layer_0, key=lambda n: abs(float(graph.rows[graph.n_features, n])))
    _assert_split_is_measured(model, graph, loadings, graph.logit_start, source)


def test_the_circuit_command_takes_a_clt_with_qk_and_head_loadings(tmp_path) -> None:
    """``gradpatch circuit --dictionaries`` a save_clt folder with ``--qk`` and ``--head-loadings``: status 0, each
    score's terms within 1e-4 of it, each split edge's layers summing to it within 1e-5 relative."""
    from gradpatch.files.loaders import load_model
    from recipes import cli
    from recipes.testing import save_tiny_backbone

    torch.set_num_threads(1)
    model_dir = save_tiny_backbone(tmp_path / "tiny")
    model, _ = load_model(model_dir)
    save_clt(_clt(2), tmp_path / "clt", model=model)
    out = tmp_path / "out"
    assert cli.main(["circuit", "--prompt", "the capital of France is Paris and the capital of Italy is",
                     "--dictionaries", str(tmp_path / "clt"), "--model", str(model_dir), "--device", "cpu",
                     "--batch-size", "64", "--out", str(out), "--qk", "1@1:-1", "--qk-keys", "2",
                     "--head-loadings", "--head-loading-sources", "5"]) == 0
    scores = json.loads((out / "qk.json").read_text())["scores"]
    assert len(scores) == 2 and all(s["missed"] <= 1e-4 * abs(s["score"]) + 1e-7 * s["terms_abs_sum"]
                                    for s in scores)
    edges = json.loads((out / "head_loadings.json").read_text())["edges"]
    assert edges and all(len(e["layers"]) == 2 for e in edges)
    for edge in edges:
        for split in edge["layers"].values():
            missed = abs(sum(split["heads"]) + split["bypass"] - edge["weight"])
            assert missed <= 1e-5 * abs(edge["weight"]) or abs(edge["weight"]) <= 1e-4
