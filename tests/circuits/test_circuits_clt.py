"""Attribution graphs over a cross-layer transcoder (gradpatch.circuits with a CrossLayerTranscoder) on the tiny
Llama and the tiny GPT-2 with a random ReLU CLT over both layers (with and without skip terms): the replay is the
model's, every target is the sum of its edges plus its bias, sampled edges are exact perturbations of the frozen
model through every layer a feature writes, and a layer-0 feature's edge to a logit includes its layer-1 decoder;
source perturbations, interventions (direct and live), load_transcoders and ``gradpatch circuit`` with a CLT."""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file
import torch

from gradpatch import PatchableGraph
from gradpatch.circuits import (AttributionGraph, FeatureEdit, ReplacementModel, attribute, completeness,
                                decoder_logit_weights, intervene, intervene_direct, load_transcoders, parse_node_id)
from gradpatch.circuits.clt_layers import CLTLayerView
from gradpatch.circuits.sources import source_deltas
from gradpatch.dictionaries import CLTConfig, CrossLayerTranscoder, export_circuit_tracer_clt, save_clt

from test_circuits import MODELS, _change


def tiny_clt_replacement(name: str, prompt: torch.Tensor, skip: bool) -> ReplacementModel:
    """The replacement model of :data:`MODELS`' ``name`` with a random ReLU CLT (64 latents per layer) over both
    MLPs; b_enc > 0 on average so that features fire, b_dec and W_skip nonzero."""
    build, read, write = MODELS[name]
    pg = PatchableGraph(build(), prompt, use_cache=False)
    generator = torch.Generator().manual_seed(0)
    config = CLTConfig(activation="relu", n_layers=2, d_in=64, d_sae=64, skip=skip,
                       input_nodes=[read.format(layer) for layer in range(2)],
                       output_nodes=[write.format(layer) for layer in range(2)])
    clt = CrossLayerTranscoder(config, generator=generator)
    with torch.no_grad():
        clt.b_enc.normal_(0.02, 0.05, generator=generator)
        clt.b_dec.normal_(0, 0.01, generator=generator)
        if skip:
            clt.W_skip.normal_(0, 0.05, generator=generator)
    return ReplacementModel(pg, clt, prompt)


@pytest.fixture(scope="module")
def prompt() -> torch.Tensor:
    return torch.randint(0, 100, (1, 7), generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module", params=[("llama", True), ("gpt2", False)], ids=["llama-skip", "gpt2"])
def replacement(request, prompt) -> ReplacementModel:
    name, skip = request.param
    return tiny_clt_replacement(name, prompt, skip)


@pytest.fixture(scope="module")
def graph(replacement) -> AttributionGraph:
    return attribute(replacement, batch_size=32)  # raises IncompleteGraphError unless every logit row adds up


def _feature_delta(replacement: ReplacementModel, layer: int, position: int, feature: int) -> dict[int, torch.Tensor]:
    """δ per MLP output that raises feature (layer, position, feature)'s activation by 1: its decoder row into
    every layer it writes."""
    view = replacement.layers[layer].transcoder
    assert isinstance(view, CLTLayerView)
    deltas = {}
    for written, decoder in view.decoder_blocks():
        delta = torch.zeros_like(replacement.layers[written].constant)
        delta[0, position] = decoder[feature]
        deltas[written] = delta
    return deltas


def test_replacement_model_replays_the_prompt(replacement) -> None:
    with torch.no_grad():
        run = replacement.run()
        logits = replacement.pg(replacement.ids).logits
    assert torch.equal(run.logits, replacement.logits)  # bit for bit
    assert torch.equal(replacement.logits, logits)  # the CLT's error terms make the recording pass the model's
    assert set(replacement.layers) == {0, 1}
    for spliced in replacement.layers.values():
        assert spliced.activations.count_nonzero() > 20


def test_each_target_is_the_sum_of_its_edges_plus_its_bias(graph, replacement) -> None:
    assert graph.n_features > 50 and len(graph.logit_tokens) >= 1
    found = completeness(replacement, graph)
    assert float(found.errors.max()) <= 1e-4


def test_sampled_edges_match_exact_perturbations(replacement, graph) -> None:
    """Raise one feature's activation by ε = 1 in the frozen model (δ = W_dec[ℓ → ℓ'][f] at every output layer
    ℓ' ≥ ℓ): the change of each target / ε = A[t, s] / a_s, within 1e-3 of the edge."""
    features = graph.active_features.tolist()
    checked = 0
    logit_rows = list(range(graph.logit_start, graph.logit_start + 2))
    for row in [n for n, (layer, _, _) in enumerate(features) if layer == 1][:4] + logit_rows:
        for source in graph.adjacency[row, :graph.n_features].abs().topk(3).indices.tolist():
            layer, position, feature = features[source]
            edge = float(graph.adjacency[row, source] / graph.activations[source])
            change = _change(replacement, graph, row, _feature_delta(replacement, layer, position, feature))
            assert abs(change - edge) <= 1e-3 * abs(edge), (row, source)
            checked += 1
    assert checked == 18


def test_a_layer_0_feature_edge_to_a_logit_includes_its_layer_1_decoder(replacement, graph) -> None:
    """The edge of a layer-0 feature to a logit differs from what its layer-0 decoder block alone gives (the one
    block a per-layer transcoder would have), by its layer-1 block's change of the logit."""
    row = graph.logit_start
    layer_0 = [n for n, (layer, _, _) in enumerate(graph.active_features.tolist()) if layer == 0]
    source = max(layer_0, key=lambda n: abs(float(graph.adjacency[row, n])))
    _, position, feature = graph.active_features[source].tolist()
    deltas = _feature_delta(replacement, 0, position, feature)
    edge = float(graph.adjacency[row, source] / graph.activations[source])
    first = _change(replacement, graph, row, {0: deltas[0]})
    second = _change(replacement, graph, row, {1: deltas[1]})
    assert abs(second) > 1e-3 * abs(edge)
    assert abs(edge - first) > 1e-3 * abs(edge)
    assert abs(edge - first - second) <= 1e-3 * abs(edge)


def test_source_deltas_and_direct_interventions_write_every_later_layer(replacement, graph) -> None:
    """A layer-0 feature's source perturbation is a · its decoder row at both layers, and ablating it in the frozen
    model changes each logit by −A[t, s] (its edges through both layers)."""
    row = graph.logit_start
    layer_0 = [n for n, (layer, _, _) in enumerate(graph.active_features.tolist()) if layer == 0]
    source = max(layer_0, key=lambda n: abs(float(graph.adjacency[row, n])))
    _, position, feature = graph.active_features[source].tolist()
    deltas, _ = source_deltas(replacement, graph, [{source: 1.0}])
    for written, delta in _feature_delta(replacement, 0, position, feature).items():
        torch.testing.assert_close(deltas[written], delta * graph.activations[source])
    result = intervene_direct(replacement, [FeatureEdit(0, position, feature, "ablate")])
    token = int(graph.logit_tokens[0])
    shift = (result.logits_after - result.logits_before)[0, -1]
    edge = float(graph.adjacency[row, source])
    assert abs(float(shift[token] - shift.mean()) + edge) <= 1e-3 * abs(edge)


def test_live_intervention_with_a_clt(replacement) -> None:
    """``intervene`` with the CLT: clamping a firing layer-0 latent to its own value keeps the logits; ablating it
    reports its activation and changes the logits."""
    clt = replacement.clt
    assert clt is not None
    ids, pg = replacement.ids, replacement.pg
    activations = replacement.layers[0].activations[0]
    position, feature = (int(i) for i in (activations == activations[2:].max()).nonzero()[0])
    value = float(activations[position, feature])
    unchanged = intervene(pg, clt, ids, [FeatureEdit(0, position, feature, "clamp", value)])
    torch.testing.assert_close(unchanged.logits_after, unchanged.logits_before, rtol=0, atol=1e-5)
    ablated = intervene(pg, clt, ids, [FeatureEdit(0, position, feature, "ablate")])
    assert ablated.activations == pytest.approx([value])
    assert float((ablated.logits_after - ablated.logits_before).abs().max()) > 1e-4


def test_load_transcoders_gives_a_saved_or_exported_clt(prompt, tmp_path) -> None:
    """A folder of save_clt's files or of circuit-tracer's CLT layout loads as the CLT, which builds the same
    replacement model."""
    replacement = tiny_clt_replacement("gpt2", prompt, skip=False)
    clt = replacement.clt
    assert clt is not None
    save_clt(clt, tmp_path / "ours")
    export_circuit_tracer_clt(clt, tmp_path / "theirs")
    read, write = "transformer.h_{layer}.mlp.hidden_states", "transformer.h_{layer}.mlp.output"
    for folder in ("ours", "theirs"):
        loaded = load_transcoders(tmp_path / folder, None, read, write)
        assert isinstance(loaded, CrossLayerTranscoder)
        torch.testing.assert_close(loaded.W_dec[0], clt.W_dec[0], rtol=0, atol=0)
        rebuilt = ReplacementModel(replacement.pg, loaded, prompt)
        assert torch.equal(rebuilt.logits, replacement.logits)
        for layer in (0, 1):
            torch.testing.assert_close(rebuilt.layers[layer].errors, replacement.layers[layer].errors)


def test_the_circuit_command_takes_a_clt_folder(tmp_path) -> None:
    """``gradpatch circuit --dictionaries`` a save_clt folder: status 0 and the graph ``attribute`` gives on the
    CLI's replacement model (its prompt, a special token first); an --intervene runs through the CLT."""
    from gradpatch.files.loaders import load_model
    from recipes import cli
    from gradpatch.circuits import with_special_first
    from recipes.testing import save_tiny_backbone

    torch.set_num_threads(1)
    model_dir = save_tiny_backbone(tmp_path / "tiny")
    model, tokenizer = load_model(model_dir)
    generator = torch.Generator().manual_seed(0)
    clt = CrossLayerTranscoder(CLTConfig(activation="relu", n_layers=2, d_in=64, d_sae=64, skip=True,
                                         input_nodes=[f"model.layers_{i}.mlp.x" for i in range(2)],
                                         output_nodes=[f"model.layers_{i}.mlp.output" for i in range(2)]),
                               generator=generator)
    with torch.no_grad():
        clt.b_enc.normal_(0.02, 0.05, generator=generator)
        clt.W_skip.normal_(0, 0.05, generator=generator)
    save_clt(clt, tmp_path / "clt", model=model)
    text = "the capital of France is Paris and the capital of Italy is"
    out = tmp_path / "out"
    assert cli.main(["circuit", "--prompt", text, "--dictionaries", str(tmp_path / "clt"), "--model",
                     str(model_dir), "--device", "cpu", "--batch-size", "64", "--out", str(out),
                     "--intervene", "ablate:0:3:5"]) == 0
    ids = with_special_first(tokenizer(text, return_tensors="pt").input_ids, tokenizer)
    expected = attribute(ReplacementModel(PatchableGraph(model, ids, use_cache=False), clt, ids), batch_size=64)
    torch.testing.assert_close(load_file(out / "adjacency.safetensors")["rows"], expected.rows, rtol=1e-4, atol=1e-5)
    assert (out / "interventions.json").is_file()
    # a layer-0 feature's top logits: what its decoder rows into both layers write, summed, through the unembedding
    nodes = json.loads((out / "graph.json").read_text())["nodes"]
    node = next(n for n in nodes if n["feature_type"] == "cross layer transcoder" and n["layer"] in (0, "0"))
    _, _, feature = parse_node_id(node["node_id"])
    with torch.no_grad():
        total = clt.W_dec[0][feature].sum(0, keepdim=True)
        weights = decoder_logit_weights(total, model.lm_head.weight, model.model.norm)[0]
        alone = decoder_logit_weights(clt.W_dec[0][feature, :1], model.lm_head.weight, model.model.norm)[0]
    tokens = [t["token"] for t in node["top_logits"]]
    assert tokens == weights.topk(len(tokens)).indices.tolist()
    assert tokens != alone.topk(len(tokens)).indices.tolist()
