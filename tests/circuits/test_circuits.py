"""Attribution graphs (gradpatch.circuits) on the tiny Llama (SDPA and eager attention) and the tiny GPT-2 with
random skip transcoders at both MLPs: the frozen nodes found from the graph, the exactness of the linearisation
(each target = Σ incoming edges + its bias; sampled edges = exact perturbations of the frozen model), bad input, pruning, scores and files."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file

from gradpatch import PatchableGraph, testing
from gradpatch.circuits import (AttributionGraph, CircuitError, FrozenNodesNotFoundError, ReplacementModel,
                                attribute, compute_influence, find_frozen_nodes, frontend_graph, graph_influence,
                                graph_scores, node_records, normalize_matrix, prune_graph, save_graph)
from gradpatch.dictionaries import SkipTranscoder, SparseAutoencoder
from gradpatch.errors import FingerprintMismatchError


def _llama(attention: str = "sdpa") -> torch.nn.Module:
    model = testing.tiny_llama(100, hidden=64, intermediate=128, init_std=0.02, max_position_embeddings=128,
                               pad_token_id=None, bos_token_id=1, eos_token_id=2)
    model.config._attn_implementation = attention
    return model


@pytest.fixture(scope="module")
def prompt() -> torch.Tensor:
    return torch.randint(0, 100, (1, 7), generator=torch.Generator().manual_seed(3))


def _gpt2() -> torch.nn.Module:
    return testing.tiny_gpt2(100, hidden=64, init_std=0.02, n_positions=128)


#: model -> (builder, MLP input and output NodePaths with {} for the layer).
MODELS = {"llama": (_llama, "model.layers_{}.mlp.x", "model.layers_{}.mlp.output"),
          "llama-eager": (lambda: _llama("eager"), "model.layers_{}.mlp.x", "model.layers_{}.mlp.output"),
          "gpt2": (_gpt2, "transformer.h_{}.mlp.hidden_states", "transformer.h_{}.mlp.output")}


def tiny_replacement(name: str, prompt: torch.Tensor) -> ReplacementModel:
    """The replacement model of :data:`MODELS`' ``name``: ReLU skip transcoders (64 latents) at both MLPs, random
    weights (also benchmarks/circuits/scale.py's tiny models)."""
    build, read, write = MODELS[name]
    pg = PatchableGraph(build(), prompt, use_cache=False)
    generator = torch.Generator().manual_seed(0)
    transcoders = {}
    for layer in range(2):
        transcoder = SkipTranscoder(64, 64, activation="relu", input_node=read.format(layer),
                                    output_node=write.format(layer), generator=generator)
        with torch.no_grad():
            transcoder.W_skip.normal_(0, 0.05, generator=generator)
            transcoder.b_dec.normal_(0, 0.01, generator=generator)
        transcoders[layer] = transcoder
    return ReplacementModel(pg, transcoders, prompt)


@pytest.fixture(scope="module", params=sorted(MODELS))
def replacement(request, prompt) -> ReplacementModel:
    return tiny_replacement(request.param, prompt)


@pytest.fixture(scope="module")
def graph(replacement) -> AttributionGraph:
    return attribute(replacement, batch_size=32)


@pytest.fixture(scope="module")
def kept(replacement) -> AttributionGraph:
    """The graph with position 0's features and errors as nodes."""
    return attribute(replacement, batch_size=32, zero_first_position=False)


def _zeroed(replacement: ReplacementModel, first: int = 0) -> dict[int, torch.Tensor]:
    """δ_ℓ that remove every feature's and error's contribution at positions ≥ ``first`` (the MLP output there
    becomes b_dec + skip)."""
    deltas = {layer: -(spliced.constant - spliced.transcoder.b_dec) for layer, spliced in replacement.layers.items()}
    for delta in deltas.values():
        delta[:, :first] = 0
    return deltas


def test_frozen_nodes_found_from_the_graph() -> None:
    ids = torch.zeros(1, 4, dtype=torch.long)
    frozen = find_frozen_nodes(PatchableGraph(_llama(), ids, use_cache=False))
    assert frozen.attention == tuple(f"model.layers_{i}.self_attn.{name}" for i in range(2)
                                     for name in ("q_embed", "k_embed"))  # SDPA: its query and key arguments
    assert frozen.norms == (*(f"model.layers_{i}.{norm}.rsqrt" for i in range(2)
                              for norm in ("input_layernorm", "post_attention_layernorm")), "model.norm.rsqrt")
    eager = find_frozen_nodes(PatchableGraph(_llama("eager"), ids, use_cache=False))
    assert eager.attention == ("model.layers_0.self_attn.softmax", "model.layers_1.self_attn.softmax")
    gpt2 = find_frozen_nodes(PatchableGraph(_gpt2(), ids, use_cache=False))
    assert gpt2.attention == tuple(f"transformer.h_{i}.attn.{name}_states_1" for i in range(2)
                                   for name in ("query", "key"))
    assert not gpt2.norms
    assert [(norm.input, norm.output) for norm in gpt2.layer_norms] == [
        *((f"transformer.h_{i}.{ln}.input", f"transformer.h_{i}.{ln}.layer_norm") for i in range(2)
          for ln in ("ln_1", "ln_2")), ("transformer.ln_f.input", "transformer.ln_f.layer_norm")]


def test_graph_without_frozen_nodes_is_refused() -> None:
    mlp = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    with pytest.raises(FrozenNodesNotFoundError, match="softmax.*scaled_dot_product_attention.*rsqrt.*layer_norm"):
        find_frozen_nodes(PatchableGraph(mlp, torch.zeros(2, 4)))


def test_bad_input_is_refused(replacement, prompt) -> None:
    transcoder = replacement.layers[0].transcoder
    with pytest.raises(CircuitError, match=r"ids \[1, seq\]"):
        ReplacementModel(replacement.pg, {0: transcoder}, prompt.expand(2, -1))
    sae = SparseAutoencoder(64, 32, activation="relu", node=replacement.layers[0].input_node)
    with pytest.raises(CircuitError, match="not a sae"):
        ReplacementModel(replacement.pg, {0: sae}, prompt)
    with pytest.raises(CircuitError, match="at least one"):
        ReplacementModel(replacement.pg, {}, prompt)
    with pytest.raises(CircuitError, match="more than the model's context of 128"):
        ReplacementModel(replacement.pg, {0: transcoder}, torch.zeros(1, 129, dtype=torch.long))
    other = SkipTranscoder.from_config(dataclasses.replace(transcoder.config, model_fingerprint="0123456789abcdef"))
    with pytest.raises(FingerprintMismatchError, match="0123456789abcdef"):
        ReplacementModel(replacement.pg, {0: other}, prompt)


def test_replacement_model_replays_the_prompt(replacement) -> None:
    with torch.no_grad():
        run = replacement.run()
    assert torch.equal(run.logits, replacement.logits)  # bit for bit
    for layer, spliced in replacement.layers.items():
        assert torch.equal(run.pre_activations[layer], spliced.transcoder.pre_activations(spliced.inputs))
        assert torch.equal(spliced.activations, spliced.transcoder.encode(spliced.inputs))


@pytest.mark.parametrize("zero_first_position", [True, False])
def test_each_target_is_the_sum_of_its_edges_plus_its_bias(replacement, graph, kept, zero_first_position) -> None:
    """h = Σ_s A[h, s] + bias, the bias being h with every source removed (the frozen model is affine; with
    ``zero_first_position`` position 0's features and errors are not sources and stay in the bias); within 1e-4 of
    the size of the terms summed, Σ_s |A[h, s]| + |bias| (float32 cancellation between large terms)."""
    graph = graph if zero_first_position else kept
    assert graph.n_features > 50 and len(graph.logit_tokens) >= 1
    with torch.no_grad():
        full = replacement.run()
        bias = replacement.run(1, _zeroed(replacement, int(zero_first_position)), -replacement.embeddings)
    targets, biases, rows = [], [], []
    for row, (layer, position, feature) in enumerate(graph.active_features.tolist()):
        targets.append(full.pre_activations[layer][0, position, feature])
        biases.append(bias.pre_activations[layer][0, position, feature])
        rows.append(row)
    for row, token in enumerate(graph.logit_tokens.tolist(), graph.logit_start):
        targets.append(full.logits[0, -1, token] - full.logits[0, -1].mean())
        biases.append(bias.logits[0, -1, token] - bias.logits[0, -1].mean())
        rows.append(row)
    target, constant = torch.stack(targets), torch.stack(biases)
    edges = graph.adjacency[rows]
    scale = edges.abs().sum(1) + constant.abs()
    assert bool(((target - edges.sum(1) - constant).abs() <= 1e-4 * scale).all())
    assert not graph.adjacency[graph.error_start:graph.logit_start].any()  # errors and tokens have no inputs


def _change(replacement: ReplacementModel, graph: AttributionGraph, row: int, deltas: dict[int, torch.Tensor],
            embed_delta: torch.Tensor | None = None) -> float:
    """The change of target ``row`` when the frozen model's MLP outputs and embeddings are perturbed."""
    with torch.no_grad():
        before, after = replacement.run(), replacement.run(1, deltas, embed_delta)
    if row < graph.n_features:
        layer, position, feature = graph.active_features[row].tolist()
        return float((after.pre_activations[layer] - before.pre_activations[layer])[0, position, feature])
    token = int(graph.logit_tokens[row - graph.logit_start])
    shift = after.logits[0, -1] - before.logits[0, -1]
    return float(shift[token] - shift.mean())


def test_sampled_edges_match_exact_perturbations(replacement, graph) -> None:
    """Raise one feature's activation by ε = 1 in the frozen model (δ = ε W_dec[f] at its layer and position, every
    other MLP output held): the change of each target / ε = A[t, s] / a_s, within 1e-3 of the edge; likewise the
    largest error and token source of each logit (δ = ε e_ℓp, δ_E = ε E_p: change / ε = A[t, s])."""
    features = graph.active_features.tolist()
    checked = 0
    logit_rows = list(range(graph.logit_start, graph.logit_start + 2))
    for row in [n for n, (layer, _, _) in enumerate(features) if layer == 1][:6] + logit_rows:
        for source in graph.adjacency[row, :graph.n_features].abs().topk(3).indices.tolist():
            layer, position, feature = features[source]
            delta = torch.zeros_like(replacement.layers[layer].constant)
            delta[0, position] = replacement.layers[layer].transcoder.W_dec[feature].detach()
            edge = float(graph.adjacency[row, source] / graph.activations[source])
            assert abs(_change(replacement, graph, row, {layer: delta}) - edge) <= 1e-3 * abs(edge), (row, source)
            checked += 1
    for row in logit_rows:
        errors = graph.adjacency[row, graph.error_start:graph.token_start]
        index = int(errors.abs().argmax())
        layer, position = graph.layers[index // graph.n_pos], index % graph.n_pos
        delta = torch.zeros_like(replacement.layers[layer].constant)
        delta[0, position] = replacement.layers[layer].errors[0, position]
        edge = float(errors[index])
        assert abs(_change(replacement, graph, row, {layer: delta}) - edge) <= 1e-3 * abs(edge)
        position = int(graph.adjacency[row, graph.token_start:graph.logit_start].abs().argmax())
        embed_delta = torch.zeros_like(replacement.embeddings)
        embed_delta[0, position] = replacement.embeddings[0, position]
        edge = float(graph.adjacency[row, graph.token_start + position])
        assert abs(_change(replacement, graph, row, {}, embed_delta) - edge) <= 1e-3 * abs(edge)
        checked += 2
    assert checked == 28


def test_position_zero_has_no_feature_node_and_no_edges(replacement, graph, kept) -> None:
    """circuit-tracer's convention (the default): no feature node at position 0, the error nodes at position 0
    without edges; every other node and edge as in the graph that keeps position 0 (within 1e-5, the batches'
    targets differ)."""
    assert graph.zero_first_position and not kept.zero_first_position
    assert bool((graph.active_features[:, 1] >= 1).all())
    at_zero = kept.active_features[:, 1] == 0
    assert int(at_zero.sum()) > 0  # the tiny models have active features at position 0
    assert torch.equal(graph.active_features, kept.active_features[~at_zero])
    assert torch.equal(graph.activations, kept.activations[~at_zero])
    features = (~at_zero).nonzero().squeeze(-1)
    n_kept = kept.adjacency.shape[0]
    others = torch.cat([features, torch.arange(kept.error_start, n_kept)])  # rows and columns of graph, in kept
    assert graph.adjacency.shape == (len(others), len(others))
    errors_at_zero = [graph.error_start + index * graph.n_pos for index in range(len(graph.layers))]
    assert not graph.adjacency[:, errors_at_zero].any() and not graph.adjacency[errors_at_zero].any()
    assert kept.adjacency[:, [kept.error_start + i * kept.n_pos for i in range(len(kept.layers))]].any()
    expected = kept.adjacency[others][:, others].clone()
    expected[:, errors_at_zero] = 0
    torch.testing.assert_close(graph.adjacency, expected, rtol=1e-5, atol=1e-6)


def test_batching_does_not_change_the_graph(replacement, graph) -> None:
    torch.testing.assert_close(attribute(replacement, batch_size=5).adjacency, graph.adjacency, rtol=1e-5, atol=1e-6)


def test_influence_is_the_sum_of_matrix_powers() -> None:
    adjacency = torch.tensor([[0.0, 0.0, 0.0], [2.0, 0.0, 0.0], [1.0, -3.0, 0.0]])
    normalized = normalize_matrix(adjacency)
    weights = torch.tensor([0.0, 0.0, 1.0])
    expected = weights @ (torch.linalg.inv(torch.eye(3) - normalized) - torch.eye(3))
    torch.testing.assert_close(compute_influence(normalized, weights), expected)
    rows = torch.tensor([2, 1])  # the rows with edges alone, in any order: the same influence
    torch.testing.assert_close(compute_influence(normalize_matrix(adjacency[rows]), weights, rows), expected)


def test_pruning_and_scores(graph) -> None:
    pruned = prune_graph(graph)
    n, targets = graph.n_nodes, graph.target_nodes
    assert pruned.node_mask.shape == (n,) and pruned.edge_mask.shape == (len(targets), n)  # the target rows only
    assert bool(pruned.node_mask[graph.token_start:].all())
    assert 0 < int(pruned.node_mask[:graph.n_features].sum()) < graph.n_features
    assert not pruned.edge_mask[~pruned.node_mask[targets]].any() and not pruned.edge_mask[:, ~pruned.node_mask].any()
    with pytest.raises(CircuitError, match="node_threshold"):
        prune_graph(graph, node_threshold=1.5)
    replacement_score, completeness = graph_scores(graph)
    assert 0.0 <= replacement_score <= 1.0 and 0.0 <= completeness <= 1.0
    unpruned = graph_influence(graph)  # computed once and handed over: the same masks and scores
    again = prune_graph(graph, unpruned=unpruned)
    assert torch.equal(again.node_mask, pruned.node_mask) and torch.equal(again.edge_mask, pruned.edge_mask)
    assert graph_scores(graph, unpruned) == (replacement_score, completeness)


def test_files(graph, tmp_path) -> None:
    save_graph(graph, tmp_path, prompt="p")
    tensors = load_file(str(tmp_path / "adjacency.safetensors"))
    assert set(tensors) == {"rows", "row_nodes", "activations"}  # no [n, n] on disk
    assert torch.equal(tensors["rows"], graph.rows) and torch.equal(tensors["row_nodes"], graph.target_nodes)
    dense = torch.zeros(graph.n_nodes, graph.n_nodes)
    dense[tensors["row_nodes"]] = tensors["rows"]
    assert torch.equal(dense, graph.adjacency)
    assert torch.equal(tensors["activations"], graph.activations)
    nodes = json.loads((tmp_path / "nodes.json").read_text())["nodes"]
    assert len(nodes) == graph.n_nodes == tensors["rows"].shape[1]
    assert nodes[0]["kind"] == "feature" and nodes[0]["node_path"].endswith("mlp.output")
    assert [node["kind"] for node in nodes[graph.token_start:graph.logit_start]] == ["token"] * graph.n_pos
    assert nodes[-1]["kind"] == "logit" and nodes[-1]["node_path"] == "output|logits"
    frontend = json.loads((tmp_path / "graph.json").read_text())
    assert set(frontend) == {"metadata", "qParams", "nodes", "links"}
    ids = {node["node_id"] for node in frontend["nodes"]}
    assert all(link["source"] in ids and link["target"] in ids for link in frontend["links"])
    kinds = {node["feature_type"] for node in frontend["nodes"]}
    assert {"embedding", "logit", "cross layer transcoder"} <= kinds
    assert sum(node["is_target_logit"] for node in frontend["nodes"]) == 1


def _hand_built(nodes: list[str] | None = None) -> AttributionGraph:
    """A graph built by hand, without NodePaths: 2 features, 1 layer × 3 positions of errors, 3 tokens, 2 logits."""
    adjacency = torch.zeros(10, 10)
    adjacency[0, 5], adjacency[1, 0], adjacency[8, 1], adjacency[9, 6], adjacency[8, 7] = 0.5, 2.0, 1.0, 0.3, 0.2
    return AttributionGraph(input_tokens=torch.tensor([4, 5, 6]), layers=[0],
                            active_features=torch.tensor([[0, 1, 7], [0, 2, 3]]), activations=torch.tensor([1.0, 2.0]),
                            logit_tokens=torch.tensor([8, 9]), logit_probabilities=torch.tensor([0.7, 0.2]),
                            rows=adjacency[[0, 1, 8, 9]], nodes=nodes or [])


def test_a_graph_built_by_hand_has_a_record_per_node_and_a_frontend_graph() -> None:
    """``nodes`` left at its default ``[]``: every node still gets its record (``node_path`` ``None``), and the
    frontend graph is drawn from them (it raised IndexError on no records)."""
    graph = _hand_built()
    records = node_records(graph)
    assert [r["kind"] for r in records] == ["feature"] * 2 + ["error"] * 3 + ["token"] * 3 + ["logit"] * 2
    assert [r["index"] for r in records] == list(range(10)) and {r["node_path"] for r in records} == {None}
    frontend = frontend_graph(graph, node_threshold=1.0, edge_threshold=1.0)
    assert {"0_7_1", "0_3_2", "E_4_0", "2_8_2"} <= {node["node_id"] for node in frontend["nodes"]}


def test_node_records_name_what_to_set_when_the_graph_does_not_add_up() -> None:
    with pytest.raises(CircuitError, match=r"graph.nodes holds 2 NodePaths for 10 nodes; set one per node"):
        node_records(_hand_built(["a", "b"]))
    graph = dataclasses.replace(_hand_built(), rows=torch.zeros(4, 9))
    with pytest.raises(CircuitError, match=r"the rows are \(4, 9\), but the graph has 10 nodes .* set rows "
                                           r"to \[4, 10\]"):
        node_records(graph)
