"""Cross-layer transcoders: the module against a direct computation of the CLT equations, splicing into tiny Llama,
tiny GPT-2 and SmolLM2 (exact with the error terms, latents read out, edits changing each output node by their
decoder effect, KV-cache generation, gradients), our files and circuit-tracer's layout, and bad input refused."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from gradpatch import HoldPatch, NodePathError, PatchableGraph, testing
from gradpatch.dictionaries import (CLTConfig, CrossLayerTranscoder, DictionaryConfigError, DictionaryLoadError,
                                    DictionaryShapeError, export_circuit_tracer_clt, load_circuit_tracer_clt,
                                    load_clt, save_clt, splice_clt, trained_positions)
from gradpatch.errors import FingerprintMismatchError
from gradpatch.layouts import LAYOUTS, detect_layout

IDS = testing.random_prompt_batch().clean  # [3, 6]
GREEDY = {"do_sample": False, "pad_token_id": 0, "max_new_tokens": 3}


@pytest.fixture(scope="module")
def llama3() -> torch.nn.Module:
    """A 3-layer tiny Llama (d_model 64), so that a CLT has a layer with two earlier layers."""
    return testing.tiny_llama(100, hidden=64, intermediate=128, layers=3, init_std=0.02, max_position_embeddings=128)


@pytest.fixture(scope="module")
def llama3_graph(llama3) -> PatchableGraph:
    return PatchableGraph(llama3, IDS, use_cache=False)


def _clt(pg: PatchableGraph, activation: str = "relu", k: int | None = None, skip: bool = False, m: int = 40,
         seed: int = 0, n_layers: int | None = None) -> CrossLayerTranscoder:
    """A random CLT over the MLPs of ``pg`` (biases and skip weights random too, so every term is exercised)."""
    layout = detect_layout(pg)
    n_layers = n_layers or _model_layers(pg)
    config = CLTConfig(activation, n_layers, 64, m, k=k, skip=skip,
                       input_nodes=[layout.path("mlp_input", i) for i in range(n_layers)],
                       output_nodes=[layout.path("mlp", i) for i in range(n_layers)])
    clt = CrossLayerTranscoder(config, generator=torch.Generator().manual_seed(seed))
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        clt.b_enc.normal_(0, 0.1, generator=g)
        clt.b_dec.normal_(0, 0.1, generator=g)
        if skip:
            clt.W_skip.normal_(0, 0.05, generator=g)
        if activation == "jumprelu":
            clt.threshold.uniform_(0, 0.1, generator=g)
    return clt


def _model_layers(pg: PatchableGraph) -> int:
    return int(pg.config.num_hidden_layers)


def _reference(clt: CrossLayerTranscoder, xs: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Latents and outputs of the CLT equations written out directly (ReLU / JumpReLU / TopK)."""
    config, latents = clt.config, []
    for layer, x in enumerate(xs):
        h = torch.einsum("...d,dm->...m", x, clt.W_enc[layer]) + clt.b_enc[layer]
        if config.activation == "relu":
            a = torch.clamp(h, min=0)
        elif config.activation == "jumprelu":
            a = h * (h > clt.threshold[layer])
        else:
            kept = h.topk(int(config.k), dim=-1).indices
            a = torch.zeros_like(h).scatter(-1, kept, h.gather(-1, kept)).clamp(min=0)
        latents.append(a)
    outputs = []
    for target in range(len(xs)):
        y = clt.b_dec[target] + sum(torch.einsum("...m,md->...d", latents[s], clt.W_dec[s][:, target - s])
                                    for s in range(target + 1))
        if config.skip:
            y = y + torch.einsum("...d,od->...o", xs[target], clt.W_skip[target])
        outputs.append(y)
    return latents, outputs


def _probe(pg: PatchableGraph, nodes: list[str]) -> dict[str, HoldPatch]:
    """Readers of the value at each node (``HoldPatch``es: compared by identity, so two blocks of them can nest)."""
    return {node: HoldPatch() for node in nodes}


def _values(probes: dict[str, HoldPatch], nodes: list[str]) -> list[torch.Tensor]:
    return [probes[node].held.detach() for node in nodes]


# --- the module -------------------------------------------------------------------------------------------------------


def test_config_defaults_and_refusals() -> None:
    config = CLTConfig("topk", 3, 16, 8, k=2)
    assert config.d_out == 16 and config.layers == [0, 1, 2]
    assert CLTConfig.from_dict(config.to_dict()) == config
    for bad, match in ((dict(activation="batchtopk"), "not one of"), (dict(k=None), "needs k"),
                       (dict(layers=[0, 2, 1]), "strictly increasing"), (dict(layers=[0, 1]), "strictly increasing"),
                       (dict(input_nodes=["a", "b"]), "one NodePath per CLT layer"), (dict(n_layers=0), "positive")):
        with pytest.raises(DictionaryConfigError, match=match):
            CLTConfig(**{**config.to_dict(), "layers": None, **bad})
    with pytest.raises(DictionaryConfigError, match="applies to topk only"):
        CLTConfig("relu", 2, 8, 4, k=2)
    with pytest.raises(DictionaryConfigError, match="unknown CLT config fields"):
        CLTConfig.from_dict({**config.to_dict(), "kind": "clt"})


def test_parameters_have_the_documented_shapes_and_initialisation() -> None:
    clt = CrossLayerTranscoder(CLTConfig("jumprelu", 4, 24, 300, d_out=20, skip=True),
                               generator=torch.Generator().manual_seed(0))
    assert clt.W_enc.shape == (4, 24, 300) and clt.b_enc.shape == (4, 300) and clt.threshold.shape == (4, 300)
    assert [tuple(w.shape) for w in clt.W_dec] == [(300, 4 - layer, 20) for layer in range(4)]
    assert clt.b_dec.shape == (4, 20) and clt.W_skip.shape == (4, 20, 24)
    encoder_bound, decoder_bound = 1 / math.sqrt(300), 1 / math.sqrt(4 * 20)  # U(±1/√m), U(±1/√(L·d_out))
    assert encoder_bound * 0.98 < float(clt.W_enc.detach().abs().max()) <= encoder_bound
    decoders = torch.cat([w.detach().flatten() for w in clt.W_dec])
    assert decoder_bound * 0.98 < float(decoders.abs().max()) <= decoder_bound
    assert abs(float(decoders.std()) - decoder_bound / math.sqrt(3)) < 0.02 * decoder_bound  # uniform, not normal
    assert not clt.b_enc.any() and not clt.b_dec.any() and not clt.W_skip.any()
    assert torch.equal(clt.threshold, torch.full((4, 300), 0.001))
    assert clt.decoder_vectors(1, torch.tensor([5, 7])).shape == (2, 3, 20)
    assert torch.equal(clt.decoder_vectors(2, torch.tensor([9]))[0], clt.W_dec[2][9])


@pytest.mark.parametrize("activation, k, skip", [("relu", None, False), ("jumprelu", None, True), ("topk", 3, True)])
def test_forward_computes_the_clt_equations(llama3_graph, activation: str, k: int | None, skip: bool) -> None:
    clt = _clt(llama3_graph, activation, k, skip)
    xs = [torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(layer)) for layer in range(3)]
    latents, outputs = _reference(clt, xs)
    with torch.no_grad():
        ours = clt(xs)
        for layer in range(3):
            assert torch.allclose(clt.encode(layer, xs[layer]), latents[layer], atol=1e-6)
            assert torch.allclose(ours[layer], outputs[layer], atol=1e-5)
            assert torch.allclose(clt.decode(layer, latents) + (clt.skip_term(layer, xs[layer]) if skip else 0),
                                  outputs[layer], atol=1e-5)
    if k is not None:
        assert all(int((a != 0).sum(-1).max()) <= k for a in latents)
    assert all(bool((a != 0).any()) and bool((a == 0).any()) for a in latents)  # sparse but not dead


def test_module_refuses_wrong_widths_layers_and_counts(llama3_graph) -> None:
    clt = _clt(llama3_graph)
    with pytest.raises(DictionaryShapeError, match="d_in is 64"):
        clt.encode(0, torch.zeros(2, 32))
    with pytest.raises(DictionaryConfigError, match="outside 0..2"):
        clt.encode(3, torch.zeros(2, 64))
    with pytest.raises(DictionaryShapeError, match="3 layers but got 2 inputs"):
        clt([torch.zeros(2, 64)] * 2)
    with pytest.raises(DictionaryShapeError, match="layers 0..2"):
        clt.decode(2, [torch.zeros(2, 40)] * 2)


# --- splicing ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family, activation, k, skip", [("llama3", "relu", None, False),
                                                          ("llama3", "jumprelu", None, True),
                                                          ("gpt2", "topk", 4, True)])
def test_unedited_splice_is_the_model_bit_for_bit_and_reads_every_layer(request, family: str, activation: str,
                                                                         k: int | None, skip: bool) -> None:
    pg = request.getfixturevalue("llama3_graph" if family == "llama3" else "gpt2_graph")
    clt = _clt(pg, activation, k, skip)
    inputs = _probe(pg, clt.config.input_nodes)
    with pg.patch(inputs):
        original = pg(IDS).logits
    s = splice_clt(pg, clt)
    with pg.patch(s):
        assert torch.equal(pg(IDS).logits, original)
    latents, _ = _reference(clt, _values(inputs, clt.config.input_nodes))
    assert len(s.latents) == clt.n_layers and s.first_position == 0
    for ours, expected in zip(s.latents, latents):
        assert ours.shape == (3, 6, 40) and not ours.requires_grad
        assert torch.allclose(ours, expected, atol=1e-6) and bool((ours != 0).any())


def test_without_error_terms_every_output_node_is_the_clt_output(llama3_graph) -> None:
    clt = _clt(llama3_graph, "jumprelu", skip=True)
    nodes = clt.config.input_nodes + clt.config.output_nodes
    probes = _probe(llama3_graph, nodes)
    with llama3_graph.patch(splice_clt(llama3_graph, clt, error_term=False)), llama3_graph.patch(probes):
        llama3_graph(IDS)
    _, outputs = _reference(clt, _values(probes, clt.config.input_nodes))  # the inputs as the replaced model has them
    for value, expected in zip(_values(probes, clt.config.output_nodes), outputs):
        assert torch.allclose(value, expected, atol=1e-5)


def test_edits_change_each_output_node_by_their_decoder_effect(llama3_graph) -> None:
    """Ablate / scale / clamp / steer per (layer, latent): at every output node l, the spliced value minus the
    model's value in the same pass is Σ_{s ≤ l} (a′_s − a_s) W_dec[s][:, l − s] + Σ α W_dec[s][i, l − s]."""
    pg, clt = llama3_graph, _clt(llama3_graph)
    outputs = clt.config.output_nodes
    base = splice_clt(pg, clt)
    with pg.patch(base):
        pg(IDS)
    active = [int(a[0, 0].argmax()) for a in base.latents]
    edits = dict(ablate=[(0, active[0])], scale={(1, active[1]): 3.0}, clamp={(2, 5): 2.0, (0, 7): -1.0},
                 steer={(1, 9): -1.5})
    before, after = _probe(pg, outputs), _probe(pg, outputs)
    s = splice_clt(pg, clt, **edits)
    with pg.patch(before), pg.patch(s), pg.patch(after):
        pg(IDS)
    a = s.latents  # this pass's latents, before the edits
    edited = [t.clone() for t in a]
    edited[0][..., active[0]] = 0
    edited[1][..., active[1]] *= 3
    edited[2][..., 5] = 2.0
    edited[0][..., 7] = -1.0
    for layer, node in enumerate(outputs):
        expected = sum((edited[s_] - a[s_]) @ clt.W_dec[s_][:, layer - s_].detach() for s_ in range(layer + 1))
        if layer >= 1:
            expected = expected - 1.5 * clt.W_dec[1][9, layer - 1].detach()
        change = after[node].held.detach() - before[node].held.detach()
        assert torch.allclose(change, expected, atol=1e-5), layer
        assert float(change.abs().max()) > 1e-3  # every layer is moved by an edit of its own or an earlier layer
    with pytest.raises(DictionaryConfigError, match="layer in 0..2 and latent in 0..39"):
        splice_clt(pg, clt, ablate=[(3, 0)])
    with pytest.raises(DictionaryConfigError, match="pairs"):
        splice_clt(pg, clt, scale={5: 2.0})


def test_trained_positions_generation_and_gradients(llama3_graph) -> None:
    pg = llama3_graph
    clt = _clt(pg)
    clt.config.exclude_first_positions = 1
    original = pg(IDS).logits
    s = splice_clt(pg, clt, slice=trained_positions(clt))
    with pg.patch(s):
        assert torch.equal(pg(IDS).logits, original)
    assert [tuple(a.shape) for a in s.latents] == [(3, 5, 40)] * 3 and s.first_position == 1
    expected = pg.generate(IDS[:1], **GREEDY)
    s = splice_clt(pg, clt, record=True)
    with pg.patch(s):
        assert torch.equal(pg.generate(IDS[:1], **GREEDY), expected)
    assert [tuple(z.shape) for z in s.patches[2].recorded] == [(1, 6, 40)] + [(1, 1, 40)] * 2
    with pg.patch(splice_clt(pg, clt)):
        pg(IDS).logits.logsumexp(-1).mean().backward()
    grads = [clt.W_enc.grad, clt.b_enc.grad, clt.b_dec.grad] + [w.grad for w in clt.W_dec]
    assert all(g is not None and bool(g.abs().sum() > 0) for g in grads)


def test_bad_splices_are_refused(llama3_graph, llama_graph) -> None:
    clt = _clt(llama3_graph)
    with pytest.raises(NodePathError):  # a 3-layer CLT on the 2-layer model
        splice_clt(llama_graph, clt)
    narrow = CrossLayerTranscoder(CLTConfig("relu", 3, 32, 8, input_nodes=clt.config.input_nodes,
                                            output_nodes=clt.config.output_nodes))
    with pytest.raises(DictionaryShapeError, match="input width is 32"), llama3_graph.patch(
            splice_clt(llama3_graph, narrow)):
        pass
    bare = CrossLayerTranscoder(CLTConfig("relu", 3, 64, 8))
    with pytest.raises(DictionaryConfigError, match="needs 3 input_nodes"):
        splice_clt(llama3_graph, bare)
    backwards = splice_clt(llama3_graph, clt, clt.config.input_nodes[::-1], clt.config.output_nodes[::-1])
    with pytest.raises(DictionaryShapeError, match="ran before the output nodes of CLT layers"), \
            llama3_graph.patch(backwards):
        llama3_graph(IDS)


@pytest.mark.slow
def test_smollm2_clt_over_all_30_layers_is_exact(smollm2) -> None:
    model, tokenizer = smollm2
    ids = torch.stack([tokenizer(text, return_tensors="pt").input_ids[0, :8]
                       for text in ("The Eiffel Tower is in the city of", "One, two, three, four, five, six")])
    pg = PatchableGraph(model, ids, use_cache=False)
    layout = LAYOUTS["llama"]  # SmolLM2's family (detect_layout would verify it with several forward passes)
    n_layers, d_model = model.config.num_hidden_layers, model.config.hidden_size
    assert n_layers == 30
    config = CLTConfig("relu", n_layers, d_model, 16, input_nodes=[layout.path("mlp_input", i) for i in range(30)],
                       output_nodes=[layout.path("mlp", i) for i in range(30)])
    clt = CrossLayerTranscoder(config, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        original = pg(ids).logits
        s = splice_clt(pg, clt)
        with pg.patch(s):
            assert torch.equal(pg(ids).logits, original)
        assert len(s.latents) == 30 and all(a.shape == (2, 8, 16) for a in s.latents)
        assert sum(int((a != 0).sum()) for a in s.latents) > 0
        with pg.patch(splice_clt(pg, clt, error_term=False)):
            assert float((pg(ids).logits - original).abs().max()) > 1e-2  # a random CLT replaces the MLPs badly


# --- files ------------------------------------------------------------------------------------------------------------


def test_save_and_load_round_trip_with_checks(llama3, llama3_graph, tmp_path: Path) -> None:
    clt = _clt(llama3_graph, "jumprelu", skip=True)
    save_clt(clt, tmp_path / "clt", model=llama3)
    loaded = load_clt(tmp_path / "clt", model=llama3)
    assert loaded.config == clt.config.__class__(**{**clt.config.to_dict(),
                                                   "model_fingerprint": loaded.config.model_fingerprint})
    assert loaded.config.model_fingerprint is not None
    assert all(torch.equal(a, b) for a, b in zip(clt.state_dict().values(), loaded.state_dict().values()))
    assert list(clt.state_dict()) == list(loaded.state_dict())
    with pytest.raises(FingerprintMismatchError):
        load_clt(tmp_path / "clt", model=testing.tiny_llama(100, hidden=64, intermediate=128, layers=3, seed=1))
    document = json.loads((tmp_path / "clt" / "clt.json").read_text())
    tensors = load_file(tmp_path / "clt" / "clt.safetensors")
    del tensors["W_dec.1"]
    save_file(tensors, tmp_path / "clt" / "clt.safetensors")
    with pytest.raises(DictionaryLoadError, match="SHA-256"):
        load_clt(tmp_path / "clt")
    document.pop("tensors_sha256")
    (tmp_path / "clt" / "clt.json").write_text(json.dumps(document))
    with pytest.raises(DictionaryLoadError, match=r"missing \['W_dec.1'\]"):
        load_clt(tmp_path / "clt")
    with torch.no_grad():
        clt.W_dec[2][0, 0, 0] = float("nan")
    with pytest.raises(DictionaryLoadError, match="nothing was saved"):
        save_clt(clt, tmp_path / "nan")
    assert not (tmp_path / "nan").exists()


def _circuit_tracer_files(folder: Path, n_layers: int = 3, d_sae: int = 12, d_model: int = 8,
                          threshold: bool = True, dtype: torch.dtype = torch.bfloat16) -> None:
    """Files as circuit-tracer's ``CrossLayerTranscoder.to_safetensors`` writes them."""
    folder.mkdir()
    g = torch.Generator().manual_seed(3)
    for i in range(n_layers):
        encoder = {f"W_enc_{i}": torch.randn(d_sae, d_model, generator=g),
                   f"b_enc_{i}": torch.randn(d_sae, generator=g), f"b_dec_{i}": torch.randn(d_model, generator=g)}
        if threshold:
            encoder[f"threshold_{i}"] = torch.rand(d_sae, generator=g)
        save_file({k: v.to(dtype) for k, v in encoder.items()}, folder / f"W_enc_{i}.safetensors")
        save_file({f"W_dec_{i}": torch.randn(d_sae, n_layers - i, d_model, generator=g).to(dtype)},
                  folder / f"W_dec_{i}.safetensors")


def test_circuit_tracer_layout_reads_and_writes_back_the_same_tensors(tmp_path: Path) -> None:
    _circuit_tracer_files(tmp_path / "theirs")
    clt = load_circuit_tracer_clt(tmp_path / "theirs", "model.layers_{layer}.mlp.x", "model.layers_{layer}.mlp.output")
    config = clt.config
    assert (config.activation, config.n_layers, config.d_in, config.d_sae, config.skip) == ("jumprelu", 3, 8, 12, False)
    assert config.output_nodes == [f"model.layers_{i}.mlp.output" for i in range(3)]
    assert clt.W_enc.dtype == torch.bfloat16
    first = load_file(tmp_path / "theirs" / "W_enc_1.safetensors")
    assert torch.equal(clt.W_enc[1], first["W_enc_1"].T) and torch.equal(clt.threshold[1], first["threshold_1"])
    export_circuit_tracer_clt(clt, tmp_path / "ours")
    names = sorted(p.name for p in (tmp_path / "theirs").iterdir())
    assert sorted(p.name for p in (tmp_path / "ours").iterdir()) == names
    for name in names:
        theirs, ours = load_file(tmp_path / "theirs" / name), load_file(tmp_path / "ours" / name)
        assert sorted(theirs) == sorted(ours)
        for key in theirs:
            assert ours[key].dtype == theirs[key].dtype and ours[key].shape == theirs[key].shape
            assert ours[key].contiguous().view(torch.uint8).equal(theirs[key].contiguous().view(torch.uint8))


def test_circuit_tracer_layout_refuses_bad_files_and_exports(tmp_path: Path) -> None:
    nodes = ("model.layers_{layer}.mlp.x", "model.layers_{layer}.mlp.output")
    _circuit_tracer_files(tmp_path / "a")
    (tmp_path / "a" / "W_dec_1.safetensors").unlink()
    with pytest.raises(DictionaryLoadError, match=r"W_dec_0..2.safetensors; missing layers \[1\]"):
        load_circuit_tracer_clt(tmp_path / "a", *nodes)
    _circuit_tracer_files(tmp_path / "b", threshold=False)
    tensors = load_file(tmp_path / "b" / "W_enc_2.safetensors")
    tensors["b_enc_2"][3] = float("nan")
    save_file(tensors, tmp_path / "b" / "W_enc_2.safetensors")
    with pytest.raises(DictionaryLoadError, match="'b_enc_2' holds NaN"):
        load_circuit_tracer_clt(tmp_path / "b", *nodes)
    _circuit_tracer_files(tmp_path / "c", threshold=False)
    save_file({"W_dec_1": torch.zeros(12, 3, 8)}, tmp_path / "c" / "W_dec_1.safetensors")  # [d_sae, L − 1, d] wanted
    with pytest.raises(DictionaryLoadError, match=r"'W_dec_1' has shape \(12, 3, 8\).*need \(12, 2, 8\)"):
        load_circuit_tracer_clt(tmp_path / "c", *nodes)
    _circuit_tracer_files(tmp_path / "d", threshold=False)
    save_file({"W_enc_1": torch.zeros(12, 9), "b_enc_1": torch.zeros(12), "b_dec_1": torch.zeros(8)},
              tmp_path / "d" / "W_enc_1.safetensors")  # layer 1 reads a wider node than layer 0
    with pytest.raises(DictionaryLoadError, match=r"'W_enc_1' has shape \(12, 9\).*d_model=8"):
        load_circuit_tracer_clt(tmp_path / "d", *nodes)
    with pytest.raises(DictionaryConfigError, match="no '{layer}'"):
        load_circuit_tracer_clt(tmp_path / "a", "model.layers_0.mlp.x", nodes[1])
    with pytest.raises(DictionaryLoadError, match="use load_circuit_tracer_clt"):
        load_clt(tmp_path / "b")
    for refused in (CLTConfig("topk", 2, 8, 4, k=1), CLTConfig("relu", 2, 8, 4, skip=True),
                    CLTConfig("relu", 2, 8, 4, d_out=6), CLTConfig("relu", 2, 8, 4, layers=[3, 5])):
        with pytest.raises(DictionaryConfigError):
            export_circuit_tracer_clt(CrossLayerTranscoder(refused), tmp_path / "refused")
    diverged = CrossLayerTranscoder(CLTConfig("relu", 2, 8, 4))
    with torch.no_grad():
        diverged.W_dec[1][0, 0, 0] = float("inf")
    with pytest.raises(DictionaryLoadError, match=r"\['W_dec.1'\] hold NaN or ±inf; nothing was written"):
        export_circuit_tracer_clt(diverged, tmp_path / "refused")
    assert not (tmp_path / "refused").exists()
    with pytest.raises(DictionaryConfigError, match="more layers"):  # "a" holds W_enc_2: circuit-tracer would read L=3
        export_circuit_tracer_clt(CrossLayerTranscoder(CLTConfig("relu", 2, 8, 12)), tmp_path / "a")
