"""QK attributions (gradpatch.circuits.qk) on the tiny Llama (SDPA and eager), the tiny GPT-2, a tiny Qwen3 (QK-norm,
GQA, RoPE) and a tiny OLMo 2 (QK-norm before RoPE) (Gemma 2's soft-capped scores refused), with random skip transcoders at both MLPs: the attention layers
found from the ops, the terms summing to the pre-softmax score, each sampled term equal to a perturbation of the
frozen model, the pattern row, bad input, the CLI's options (SmolLM2: tests/circuits/test_head_loadings.py)."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from gradpatch import PatchableGraph, testing
from gradpatch.circuits import AttributionGraph, ReplacementModel, attribute
from gradpatch.circuits.attention import AttentionFitError, find_attention_sites
from gradpatch.circuits.qk import BIAS, check_qk_term, pattern_row, qk_attributions, source_label
from gradpatch.dictionaries import SkipTranscoder
from recipes.cli.circuit_qk import QKRequest, add_qk_options, check_qk_options, parse_qk, write_qk_results

#: name -> (family, attention implementation, MLP input and output NodePaths with {} for the layer).
MODELS = {
    "llama": ("llama", "sdpa", "model.layers_{}.mlp.x", "model.layers_{}.mlp.output"),
    "llama-eager": ("llama", "eager", "model.layers_{}.mlp.x", "model.layers_{}.mlp.output"),
    "gpt2": ("gpt2", "sdpa", "transformer.h_{}.mlp.hidden_states", "transformer.h_{}.mlp.output"),
    "qwen3": ("qwen3", "sdpa", "model.layers_{}.mlp.x", "model.layers_{}.mlp.output"),
    "olmo2": ("olmo2", "sdpa", "model.layers_{}.mlp.x", "model.layers_{}.mlp.output"),
    "gemma2-eager": ("gemma2", "eager", "model.layers_{}.mlp.x", "model.layers_{}.mlp.output"),
}
#: The models whose scores are bilinear (Gemma 2's are soft-capped).
BILINEAR = ["gpt2", "llama", "llama-eager", "olmo2", "qwen3"]


def prompt() -> torch.Tensor:
    return torch.randint(3, 100, (1, 7), generator=torch.Generator().manual_seed(3))


def replacement(name: str, dtype: torch.dtype = torch.float32) -> ReplacementModel:
    """``name``'s tiny model (hidden 64, 4 query heads over 2 key/value heads) with ReLU skip transcoders (128
    latents, decoder scaled by 0.05) at both MLPs, in ``dtype``."""
    family, attention, read, write = MODELS[name]
    model = testing.tiny_causal_lm(family, hidden=64).to(dtype)
    model.config._attn_implementation = attention
    ids = prompt()
    pg = PatchableGraph(model, ids, use_cache=False)
    generator = torch.Generator().manual_seed(0)
    transcoders = {}
    for layer in range(2):
        transcoder = SkipTranscoder(64, 128, activation="relu", input_node=read.format(layer),
                                    output_node=write.format(layer), generator=generator)
        with torch.no_grad():
            transcoder.W_dec.mul_(0.05)
            transcoder.W_skip.normal_(0, 0.05, generator=generator)
            transcoder.b_dec.normal_(0, 0.01, generator=generator)
        transcoders[layer] = transcoder.to(dtype)
    return ReplacementModel(pg, transcoders, ids)


@pytest.fixture(scope="module", params=BILINEAR)
def built(request) -> tuple[ReplacementModel, AttributionGraph]:
    model = replacement(request.param)
    return model, attribute(model, batch_size=64)


def test_attention_layers_are_found_from_the_ops(built) -> None:
    model, _ = built
    sites = find_attention_sites(model.pg)
    assert [site.layer for site in sites] == [0, 1]
    for site in sites:
        query, key = model.pg.node(site.query).tensor_shape, model.pg.node(site.key).tensor_shape
        assert query[1] == 4 and key[1] in (2, 4) and query[-1] == key[-1]
        assert site.scale == pytest.approx(query[-1] ** -0.5)


def test_terms_sum_to_the_score_and_match_perturbations(built) -> None:
    model, graph = built
    requests = [(1, 0, 6, 2), (1, 3, 6, 6), (0, 1, 5, 1)]
    for attribution in qk_attributions(model, graph, requests, batch_size=64):
        missed, size = attribution.reconstruction()
        assert missed <= 1e-4 * abs(attribution.score) + 1e-7 * size
        assert attribution.query_parts.shape[0] == len(attribution.query_nodes) + 1
        sampled = [t for t in attribution.top_terms(6) if BIAS not in (t.query_node, t.key_node)][:3]
        assert sampled
        for term in sampled:
            check = check_qk_term(model, graph, attribution, term.query_node, term.key_node, epsilon=0.5)
            assert check.term == pytest.approx(term.value)
            assert check.measured_term == pytest.approx(check.term, rel=1e-3, abs=1e-6 * size)
            assert check.measured_row == pytest.approx(check.row, rel=1e-3, abs=1e-6 * size)


def test_scores_of_several_layers_in_one_pass_are_those_of_separate_passes(built) -> None:
    """Reading layer 0's live query must not unfreeze its pattern for layer 1's (the recorded value goes on)."""
    model, graph = built
    together = qk_attributions(model, graph, [(0, 1, 5, 1), (1, 2, 6, 3)], batch_size=1024)
    apart = qk_attributions(model, graph, [(0, 1, 5, 1), (1, 2, 6, 3)], batch_size=1)
    for one, other in zip(together, apart):
        assert torch.equal(one.query_nodes, other.query_nodes) and torch.equal(one.key_nodes, other.key_nodes)
        torch.testing.assert_close(one.terms(), other.terms(), rtol=1e-5, atol=1e-6 * float(one.terms().abs().sum()))


def test_terms_in_blocks_of_rows_give_the_whole_matrix_figures(built, monkeypatch) -> None:
    """reconstruction and top_terms over blocks of 3 query rows (a running top k) equal those of T made whole."""
    import gradpatch.circuits.qk as qk

    model, graph = built
    (attribution,) = qk_attributions(model, graph, [(1, 2, 6, 3)])
    terms = attribution.terms()
    expected_order = terms.flatten().abs().argsort(descending=True)[:7]
    monkeypatch.setattr(qk, "TERM_ROWS", 3)
    assert terms.shape[0] > 3
    missed, size = attribution.reconstruction()
    assert size == pytest.approx(float(terms.abs().sum()), rel=1e-12)
    assert missed == pytest.approx(abs(float(terms.sum()) + attribution.mask - attribution.score), abs=1e-12 * size)
    top = attribution.top_terms(7)
    assert [t.value for t in top] == pytest.approx(terms.flatten()[expected_order].tolist(), rel=1e-12)
    assert all(terms[(attribution.query_nodes.tolist() + [BIAS]).index(t.query_node),
                     (attribution.key_nodes.tolist() + [BIAS]).index(t.key_node)] == pytest.approx(t.value, rel=1e-12)
               for t in top)


def test_a_query_part_is_zero_for_a_later_position(built) -> None:
    """A source at a position after the query cannot reach it; a key's parts come from positions ≤ the key."""
    model, graph = built
    (attribution,) = qk_attributions(model, graph, [(1, 2, 3, 1)])
    positions = [int(graph.active_features[n, 1]) if n < graph.error_start else
                 ((n - graph.error_start) % graph.n_pos if n < graph.token_start else n - graph.token_start)
                 for n in attribution.key_nodes.tolist()]
    assert max(positions) <= 1
    assert source_label(graph, BIAS) == "bias"
    assert "@" in source_label(graph, int(attribution.query_nodes[0]))


def test_pattern_row_is_the_models_pattern(built) -> None:
    model, _ = built
    rows = pattern_row(model, 1, 4)
    assert rows.shape == (4, 7) and bool((rows[:, 5:] == 0).all())
    torch.testing.assert_close(rows.sum(-1), torch.ones(4))
    site = find_attention_sites(model.pg)[1]
    if site.frozen[0] not in (site.query, site.key):  # eager: the recorded softmax is the pattern itself
        torch.testing.assert_close(rows, model.frozen_values[site.frozen[0]][0, :, 4].float())


def test_bad_requests_are_refused(built) -> None:
    model, graph = built
    with pytest.raises(AttentionFitError, match="out of range"):
        qk_attributions(model, graph, [(1, 0, 2, 5)])
    with pytest.raises(AttentionFitError, match="attention layer 7 out of range"):
        qk_attributions(model, graph, [(7, 0, 2, 1)])


def test_soft_capped_scores_are_refused() -> None:
    model = replacement("gemma2-eager")
    with pytest.raises(AttentionFitError, match="tanh"):
        find_attention_sites(model.pg)
    sites = find_attention_sites(model.pg, bilinear=False)  # what head loadings need
    assert [site.query for site in sites] == [None, None] and all(s.output.endswith("attn_output") for s in sites)


def test_cli_options_write_qk_json_and_head_loadings(built, tmp_path) -> None:
    model, graph = built
    parser = argparse.ArgumentParser()
    add_qk_options(parser)
    args = parser.parse_args(["--qk", "2@1:-1", "--qk", "0@0:5:1", "--qk-keys", "2", "--qk-top-terms", "4",
                              "--head-loadings", "--head-loading-sources", "3"])
    assert check_qk_options(args) is None and parse_qk("2@1:-1") == QKRequest(2, 1, -1, None)
    assert "HEAD@LAYER:QPOS" in check_qk_options(parser.parse_args(["--qk", "1:2"]))
    written = write_qk_results(args, model, graph, tmp_path)
    assert sorted(p.name for p in written) == ["head_loadings.json", "head_loadings.safetensors", "qk.json"]
    scores = json.loads((tmp_path / "qk.json").read_text())["scores"]
    assert [(s["layer"], s["head"], s["query_position"]) for s in scores] == [(1, 2, 6)] * 2 + [(0, 0, 5)]
    assert scores[2]["key_position"] == 1 and scores[0]["pattern"] >= scores[1]["pattern"]
    assert all(len(s["top_terms"]) == 4 and s["missed"] <= 1e-4 * abs(s["score"]) + 1e-7 * s["terms_abs_sum"]
               for s in scores)
    edges = json.loads((tmp_path / "head_loadings.json").read_text())["edges"]
    assert len(edges) == 3 * len(graph.logit_tokens)
