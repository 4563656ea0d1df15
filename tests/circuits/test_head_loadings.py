"""Head loadings (gradpatch.circuits.heads) on the tiny GPT-2, Llama and Qwen3 (QK-norm) and a tiny Gemma 2 (eager,
soft-capped scores), with random skip transcoders at both MLPs: at every attention layer the heads' loadings and the
bypass sum to the edge (float64: within 1e-5 of the edge; float32: within float rounding of the terms); the bypass
and a head's loading match perturbations of the frozen model with heads held at their recorded output; the files;
and SmolLM2 with random transcoders, head loadings and a name-mover candidate's QK terms (slow)."""

from __future__ import annotations

import functools
import json

import pytest
import torch
from safetensors.torch import load_file
from test_qk import replacement

from gradpatch import PatchableGraph
from gradpatch.circuits import AttributionGraph, CircuitError, ReplacementModel, attribute
from gradpatch.circuits.attention import find_attention_sites
from gradpatch.circuits.heads import BYPASS, head_loadings, save_head_loadings
from gradpatch.circuits.qk import BIAS, check_qk_term, qk_attributions
from gradpatch.circuits.sources import source_deltas
from gradpatch.dictionaries import SkipTranscoder
from gradpatch.patches import CustomPatch, HoldPatch

#: An IOI-style prompt (name mover: the answer is the name not repeated).
IOI_PROMPT = "When Mary and John went to the store, John gave a cold drink to"


def _targets(graph: AttributionGraph) -> list[int]:
    """Two logit nodes and the last feature node (a layer-1 feature)."""
    return [graph.logit_start, graph.logit_start + 1, graph.n_features - 1]


def _check_sums(graph: AttributionGraph, loadings, relative: float, of_terms: float) -> int:
    """Assert that at every attention layer the heads' loadings and the bypass sum to the split edge: within
    ``relative`` of the edge for edges of at least 1% of their row's largest, and within ``of_terms`` of the terms'
    Σ|·| for every edge (a small edge is a difference of larger paths, whose float rounding the edge does not scale
    with); and that the split edge is the graph's (float32 rounding of its row). Returns how many (edge, layer) splits
    were checked."""
    checked = 0
    for target, source, weight in loadings.edges.tolist():
        row = graph.rows[int(target) if target < graph.n_features else graph.n_features + int(target)
                         - graph.logit_start]
        largest = float(row.abs().max())
        assert weight == pytest.approx(float(row[int(source)]), rel=1e-5, abs=1e-6 * largest)
        for per_head, bypass in loadings.edge(int(target), int(source)).values():
            missed = abs(float(per_head.sum()) + bypass - weight)
            assert missed <= of_terms * (float(per_head.abs().sum()) + abs(bypass))
            assert abs(weight) < 1e-2 * largest or missed <= relative * abs(weight)
            checked += 1
    return checked


@pytest.mark.parametrize("name", ["gpt2", "llama", "qwen3"])
def test_loadings_sum_to_each_edge_in_float64(name) -> None:
    model = replacement(name, torch.float64)
    graph = attribute(model, batch_size=64)
    loadings = head_loadings(model, graph, _targets(graph))
    assert _check_sums(graph, loadings, 1e-5, 1e-6) > 100
    assert set(loadings.indices[:, 2].tolist()) == {0, 1} and BYPASS in loadings.indices[:, 3].tolist()


@pytest.fixture(scope="module", params=["llama", "gpt2", "qwen3", "gemma2-eager"])
def built(request) -> tuple[ReplacementModel, AttributionGraph]:
    model = replacement(request.param)
    return model, attribute(model, batch_size=64)


def test_loadings_sum_to_each_edge_in_float32(built) -> None:
    model, graph = built
    loadings = head_loadings(model, graph, _targets(graph), batch_size=8)  # one target per pass
    assert _check_sums(graph, loadings, 1e-4, 3e-5) > 100


def _logit_change(model: ReplacementModel, graph: AttributionGraph, source: int, layer: int, live_head: int | None,
                  epsilon: float = 0.5) -> float:
    """Δ(logit − mean logit) / ε of the first logit node when ``source`` moves by ε, in the frozen model whose
    attention layer ``layer`` has every head's output A·V held at its recorded value except ``live_head``'s."""
    site = find_attention_sites(model.pg, bilinear=False)[layer]
    probe = HoldPatch()
    with torch.no_grad():
        model.run(1, patches={site.output: [probe]})
    recorded = probe.held.detach()

    def hold(out: torch.Tensor) -> torch.Tensor:
        kept = recorded.expand_as(out).clone()
        if live_head is not None:
            kept[:, live_head] = out[:, live_head]
        return kept

    deltas, embed = source_deltas(model, graph, [{}, {source: epsilon}])
    with torch.no_grad():
        logits = model.run(2, deltas, embed, patches={site.output: [CustomPatch(custom_op=hold)]}).logits[:, -1]
    demeaned = logits[:, int(graph.logit_tokens[0])] - logits.mean(-1)
    return float(demeaned[1] - demeaned[0]) / epsilon


def test_a_loading_is_the_edge_through_its_head(built) -> None:
    """bypass_L is the edge when every head of layer L is held at its recorded output, bypass_L + loading_L,h when
    all but head h are: both measured by moving the source in the frozen model."""
    model, graph = built
    loadings = head_loadings(model, graph, [graph.logit_start])
    order = loadings.edges[:, 2].abs().argsort(descending=True)
    target, source = (int(v) for v in loadings.edges[order[0], :2])
    for layer, (per_head, bypass) in loadings.edge(target, source).items():
        size = float(per_head.abs().sum()) + abs(bypass)
        assert _logit_change(model, graph, source, layer, None) == pytest.approx(bypass, rel=1e-3, abs=1e-5 * size)
        head = int(per_head.abs().argmax())
        assert _logit_change(model, graph, source, layer, head) == pytest.approx(bypass + float(per_head[head]),
                                                                                 rel=1e-3, abs=1e-5 * size)


def test_targets_that_have_no_edges_are_refused(built) -> None:
    model, graph = built
    with pytest.raises(CircuitError, match="not a feature or logit node"):
        head_loadings(model, graph, [graph.token_start])


def test_files_hold_the_split(built, tmp_path) -> None:
    model, graph = built
    loadings = head_loadings(model, graph, [graph.logit_start], sources=[[graph.token_start + 6, 0]])
    paths = save_head_loadings(loadings, tmp_path)
    tensors = load_file(str(paths[0]))
    assert torch.equal(tensors["indices"], loadings.indices) and tensors["heads"].tolist() == loadings.heads
    records = json.loads(paths[1].read_text())["edges"]
    assert [r["source"] for r in records] == [graph.token_start + 6, 0]
    for record in records:
        for split in record["layers"].values():
            assert sum(split["heads"]) + split["bypass"] == pytest.approx(record["weight"], rel=1e-4, abs=1e-6)


@functools.lru_cache(maxsize=1)
def smollm2_replacement() -> tuple[ReplacementModel, AttributionGraph]:
    """SmolLM2-135M on :data:`IOI_PROMPT` (BOS prepended: 16 tokens) with random TopK skip transcoders (256 latents,
    k = 4) at every MLP (benchmarks/circuits/qk_cost.py's), and its attribution graph of 256 feature nodes."""
    from gradpatch.files.loaders import load_model

    model, tokenizer = load_model(None)
    ids = tokenizer(IOI_PROMPT, return_tensors="pt").input_ids
    special = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    ids = torch.cat([torch.tensor([[special]]), ids], 1)
    pg = PatchableGraph(model, ids, use_cache=False)
    generator = torch.Generator().manual_seed(0)
    d = model.config.hidden_size
    transcoders = {}
    for layer in range(model.config.num_hidden_layers):
        transcoder = SkipTranscoder(d, 256, activation="topk", k=4, input_node=f"model.layers_{layer}.mlp.x",
                                    output_node=f"model.layers_{layer}.mlp.output", generator=generator)
        with torch.no_grad():
            transcoder.W_dec.mul_(0.05)
        transcoders[layer] = transcoder
    replaced = ReplacementModel(pg, transcoders, ids)
    return replaced, attribute(replaced, batch_size=128, max_feature_nodes=256)


@pytest.mark.slow
def test_smollm2_loadings_and_qk_terms() -> None:
    """Head loadings of the top logit's 20 strongest edges at all 30 layers; the name-mover candidate's QK terms
    (layer 24 head 4, the last position on " Mary") sum to its score and match perturbations."""
    model, graph = smollm2_replacement()
    top = graph.rows[graph.n_features].abs().topk(20).indices.tolist()
    loadings = head_loadings(model, graph, [graph.logit_start], sources=[top], batch_size=512)
    assert len(loadings.heads) == 30 and set(loadings.heads) == {9}
    assert _check_sums(graph, loadings, 1e-4, 3e-5) == 20 * 30
    (attribution,) = qk_attributions(model, graph, [(24, 4, 15, 2)])
    missed, size = attribution.reconstruction()
    assert missed <= 1e-4 * abs(attribution.score) + 1e-7 * size
    for term in [t for t in attribution.top_terms(8) if BIAS not in (t.query_node, t.key_node)][:2]:
        check = check_qk_term(model, graph, attribution, term.query_node, term.key_node)
        assert check.measured_term == pytest.approx(check.term, rel=1e-3, abs=1e-6 * size)
        assert check.measured_row == pytest.approx(check.row, rel=1e-3, abs=1e-6 * size)
