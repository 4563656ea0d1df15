"""Head loadings (gradpatch.circuits.heads) on the tiny GPT-2, Llama and Qwen3 (QK-norm) and a tiny Gemma 2 (eager,
soft-capped scores), with random skip transcoders at both MLPs: at every attention layer the heads' loadings and the
bypass sum to the edge within 1e-5 relative (circuit-tracer PR 114's check, below) in float32 and float64 models
alike; the bypass and a head's loading match perturbations of the frozen model with heads held at their recorded
output; the files; and SmolLM2 with random transcoders, head loadings and a name-mover candidate's QK terms (slow).

PR 114's check (decoderesearch/circuit-tracer pull request 114, "Add head loadings", 2026-09; its author's validation
script ``experiments/scripts/validate_head_loadings_branch.py``, run on the PR's branch): for an edge (target feature t, source s) and each attention
layer L on its path, the partition error |Σ_h loading_L,h + bypass_L − A[t, s]| / |A[t, s]|, relative to the edge
itself; the edges are those with |A[t, s]| > 1e-4 from a feature or token source to a feature of a later layer (its
heads are split for feature targets only; error sources are refused). Here the same error is asserted at every
attention layer for every split edge with |A| > 1e-4, logit targets and error sources included (a superset), and for
the smaller edges within 1e-9 of the terms' Σ|·|.
"""

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


def _is_pr114_edge(graph: AttributionGraph, target: int, source: int, weight: float) -> bool:
    """Whether PR 114's check applies to edge (target, source) (module docstring)."""
    if not (abs(weight) > 1e-4 and target < graph.n_features):
        return False
    if source < graph.n_features:
        return int(graph.active_features[source, 0]) < int(graph.active_features[target, 0])
    return source >= graph.token_start


def _check_sums(graph: AttributionGraph, loadings, relative: float = 1e-5, of_terms: float = 1e-9) -> tuple[int, int]:
    """Assert that at every attention layer the heads' loadings and the bypass sum to the split edge: within
    ``relative`` of the edge for every edge with |A| > 1e-4 (module docstring), within ``of_terms`` of the terms'
    Σ|·| for every edge; and that the split edge is the graph's row entry (float64 loadings against the float32 graph:
    within 1e-4 of it or 1e-5 of the row's largest, as circuit-tracer's graphs are compared; on SmolLM2 they differ
    by up to 1.8e-5 of the entry on some CPUs). Returns how many (edge, layer) splits were checked, and how many of
    them PR 114's check applies to."""
    checked = pr114 = 0
    for target, source, weight in loadings.edges.tolist():
        row = graph.rows[int(target) if target < graph.n_features else graph.n_features + int(target)
                         - graph.logit_start]
        largest = float(row.abs().max())
        assert weight == pytest.approx(float(row[int(source)]), rel=1e-4, abs=1e-5 * largest)
        for per_head, bypass in loadings.edge(int(target), int(source)).values():
            missed = abs(float(per_head.sum()) + bypass - weight)
            assert missed <= of_terms * (float(per_head.abs().sum()) + abs(bypass))
            assert abs(weight) <= 1e-4 or missed <= relative * abs(weight)
            checked += 1
            pr114 += _is_pr114_edge(graph, int(target), int(source), weight)
    return checked, pr114


@pytest.mark.parametrize("name", ["gpt2", "llama", "qwen3"])
def test_loadings_sum_to_each_edge_in_float64(name) -> None:
    model = replacement(name, torch.float64)
    graph = attribute(model, batch_size=64)
    loadings = head_loadings(model, graph, _targets(graph))
    checked, pr114 = _check_sums(graph, loadings)
    assert checked > 100 and pr114 > 50
    assert set(loadings.indices[:, 2].tolist()) == {0, 1} and BYPASS in loadings.indices[:, 3].tolist()


@pytest.fixture(scope="module", params=["llama", "gpt2", "qwen3", "gemma2-eager"])
def built(request) -> tuple[ReplacementModel, AttributionGraph]:
    model = replacement(request.param)
    return model, attribute(model, batch_size=64)


def test_loadings_sum_to_each_edge_in_float32(built) -> None:
    """The rows are computed on a float64 copy of the float32 model (its casts to float32 passed over), so the
    loadings meet the float64 bound; the model itself stays float32."""
    model, graph = built
    loadings = head_loadings(model, graph, _targets(graph), batch_size=8)  # one target per pass
    checked, pr114 = _check_sums(graph, loadings)
    assert checked > 100 and pr114 > 50
    assert loadings.values.dtype == torch.float64 and model.embeddings.dtype == torch.float32
    assert next(model.pg.wrapped_model.parameters()).dtype == torch.float32


def test_layers_in_groups_of_passes_give_the_loadings_of_one_pass(built) -> None:
    """A batch smaller than one target's rows splits its attention layers over passes (each with the edge's row):
    the same loadings as one pass for all; a batch below one layer's rows is refused."""
    model, graph = built
    targets = _targets(graph)[:3]
    layers = len(find_attention_sites(model.pg, bilinear=False))
    per_layer = 1 + _most_heads(model) + 1
    whole = head_loadings(model, graph, targets, batch_size=10_000)
    grouped = head_loadings(model, graph, targets, batch_size=per_layer)  # one attention layer per pass
    assert layers > 1 and torch.equal(grouped.indices, whole.indices) and torch.equal(grouped.edges, whole.edges)
    torch.testing.assert_close(grouped.values, whole.values, rtol=1e-12, atol=1e-14)
    with pytest.raises(CircuitError, match=f"give at least {per_layer}"):
        head_loadings(model, graph, targets, batch_size=per_layer - 1)


def _most_heads(model: ReplacementModel) -> int:
    """The most heads of one attention layer of ``model``."""
    return max(int(model.pg.node(site.output).tensor_shape[1]) for site in find_attention_sites(model.pg,
                                                                                               bilinear=False))


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
    _assert_split_is_measured(model, graph, loadings, target, source)


def _assert_split_is_measured(model: ReplacementModel, graph: AttributionGraph, loadings, target: int,
                              source: int) -> None:
    """At every attention layer, the bypass and bypass + the largest head's loading of the edge (target, source)
    equal :func:`_logit_change` with every head held, and with that head live (within 1e-3, or 1e-5 of the split's
    Σ|·|)."""
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
    """Head loadings at all 30 layers of the top logit's 20 strongest edges and of a layer-29 feature's 20 strongest
    edges from PR 114's sources (features of earlier layers, tokens); the name-mover candidate's QK terms (layer 24
    head 4, the last position on " Mary") sum to its score and match perturbations."""
    model, graph = smollm2_replacement()
    layers = graph.active_features[:, 0]
    feature = int((layers == layers.max()).nonzero()[-1])
    eligible = graph.rows[feature].abs().clone()
    eligible[:graph.n_features][layers >= layers[feature]] = 0
    eligible[graph.error_start:graph.token_start] = 0
    sources = [graph.rows[graph.n_features].abs().topk(20).indices.tolist(), eligible.topk(20).indices.tolist()]
    loadings = head_loadings(model, graph, [graph.logit_start, feature], sources=sources, batch_size=64)
    assert len(loadings.heads) == 30 and set(loadings.heads) == {9}
    checked, pr114 = _check_sums(graph, loadings)
    assert checked == 40 * 30 and pr114 >= 10 * 30
    (attribution,) = qk_attributions(model, graph, [(24, 4, 15, 2)])
    missed, size = attribution.reconstruction()
    assert missed <= 1e-4 * abs(attribution.score) + 1e-7 * size
    for term in [t for t in attribution.top_terms(8) if BIAS not in (t.query_node, t.key_node)][:2]:
        check = check_qk_term(model, graph, attribution, term.query_node, term.key_node)
        assert check.measured_term == pytest.approx(check.term, rel=1e-3, abs=1e-6 * size)
        assert check.measured_row == pytest.approx(check.row, rel=1e-3, abs=1e-6 * size)
