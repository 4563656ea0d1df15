"""Dictionaries spliced into the tiny Llama and GPT-2 graphs: exact with the error term (forward and KV-cache
generation), latents read out, ablate / scale / clamp / steer effects, transcoders reading one node and writing
another, gradients for training, and each bad splice refused before any forward pass."""

from __future__ import annotations

import pytest
import torch

from gradpatch import CustomPatch, NodePathError, PatchableGraph, ProbePatch, testing
from gradpatch.dictionaries import (DictionaryConfigError, DictionaryShapeError, SkipTranscoder, SparseAutoencoder,
                                    Transcoder, splice)

IDS = testing.random_prompt_batch().clean  # [3, 6]
GREEDY = {"do_sample": False, "pad_token_id": 0, "max_new_tokens": 4}


def _sae(d: int = 64, m: int = 96, activation: str = "topk", k: int | None = 8, seed: int = 0) -> SparseAutoencoder:
    sae = SparseAutoencoder(d, m, activation, k, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        sae.b_enc.normal_(0, 0.1, generator=torch.Generator().manual_seed(seed + 1))
    return sae


def _spliced_value(pg, s, node: str) -> torch.Tensor:
    """The value downstream of ``node`` with the splice applied (a probe patched after it)."""
    probe = ProbePatch()
    with pg.patch(s), pg.patch({node: probe}):
        pg(IDS)
    return probe.activation


@pytest.mark.parametrize("graph, node", [("llama_graph", "model.layers_0.output"),
                                         ("gpt2_graph", "transformer.h_1.mlp.output")])
def test_sae_with_error_term_is_exact_and_reads_latents(graph: str, node: str, request) -> None:
    pg = request.getfixturevalue(graph)
    sae = _sae()
    original = pg(IDS).logits
    s = splice(pg, sae, node)
    with pg.patch(s):
        spliced = pg(IDS).logits
    assert torch.equal(spliced, original)  # bit for bit (the requirement is 1e-5)
    assert s.latents.shape == (3, 6, 96) and int((s.latents != 0).sum(-1).max()) <= 8
    with pg.patch(splice(pg, sae, node, error_term=False)):
        reconstructed = pg(IDS).logits
    assert (reconstructed - original).abs().max() > 1e-3  # an untrained SAE reconstructs badly


def test_sae_without_error_term_writes_the_reconstruction(llama_graph) -> None:
    node = "model.layers_1.output"
    probe = ProbePatch()
    with llama_graph.patch({node: probe}):
        llama_graph(IDS)
    sae = _sae(activation="relu", k=None)
    value = _spliced_value(llama_graph, splice(llama_graph, sae, node, error_term=False), node)
    assert torch.allclose(value, sae(probe.activation), atol=1e-6)


def test_feature_edits_change_the_value_by_their_decoder_rows(llama_graph) -> None:
    node = "model.layers_0.output"
    sae = _sae(activation="relu", k=None)
    s = splice(llama_graph, sae, node)
    base = _spliced_value(llama_graph, s, node)
    z = s.latents
    active = int(z[0, 0].argmax())
    ablated = _spliced_value(llama_graph, splice(llama_graph, sae, node, ablate=[active]), node)
    assert torch.allclose(ablated - base, -z[..., active, None] * sae.W_dec[active].detach(), atol=1e-5)
    scaled = _spliced_value(llama_graph, splice(llama_graph, sae, node, scale={active: 3.0}), node)
    assert torch.allclose(scaled - base, 2 * z[..., active, None] * sae.W_dec[active].detach(), atol=1e-5)
    clamped = _spliced_value(llama_graph, splice(llama_graph, sae, node, clamp={5: 2.0}), node)
    assert torch.allclose(clamped - base, (2.0 - z[..., 5, None]) * sae.W_dec[5].detach(), atol=1e-5)
    steered = _spliced_value(llama_graph, splice(llama_graph, sae, node, steer={7: -1.5}), node)
    assert torch.allclose(steered - base, -1.5 * sae.W_dec[7].detach().expand_as(base), atol=1e-5)


def test_skip_transcoder_reads_the_mlp_input_and_replaces_its_output(llama_graph) -> None:
    read, write = "model.layers_0.mlp.x", "model.layers_0.mlp.output"
    transcoder = SkipTranscoder(64, 80, activation="topk", k=6, input_node=read, output_node=write)
    with torch.no_grad():
        transcoder.W_skip.normal_(0, 0.1, generator=torch.Generator().manual_seed(5))
    original = llama_graph(IDS).logits
    with llama_graph.patch(s := splice(llama_graph, transcoder)):
        assert torch.equal(llama_graph(IDS).logits, original)
    assert s.latents.shape == (3, 6, 80)
    probe = ProbePatch()
    with llama_graph.patch({read: probe}):
        llama_graph(IDS)
    value = _spliced_value(llama_graph, splice(llama_graph, transcoder, error_term=False), write)
    assert torch.allclose(value, transcoder(probe.activation), atol=1e-6)


def test_transcoder_splice_on_gpt2_and_generation_with_the_kv_cache(gpt2_graph) -> None:
    transcoder = Transcoder(64, 80, activation="relu")
    s = splice(gpt2_graph, transcoder, "transformer.h_0.mlp.hidden_states", output_node="transformer.h_0.mlp.output",
               record=True)
    original = gpt2_graph.generate(IDS[:1], **GREEDY)
    with gpt2_graph.patch(s):
        spliced = gpt2_graph.generate(IDS[:1], **GREEDY)
    assert torch.equal(spliced, original)
    assert [tuple(z.shape) for z in s.patch.recorded] == [(1, 6, 80)] + [(1, 1, 80)] * 3  # prefill, then each step


def test_sae_splice_during_llama_generation(llama_graph) -> None:
    s = splice(llama_graph, _sae(), "model.layers_1.output")
    original = llama_graph.generate(IDS[:1], **GREEDY)
    with llama_graph.patch(s):
        assert torch.equal(llama_graph.generate(IDS[:1], **GREEDY), original)


@pytest.mark.parametrize("error_term", [False, True])
def test_gradients_reach_the_dictionary_through_the_spliced_graph(llama_graph, error_term: bool) -> None:
    sae = _sae()
    with llama_graph.patch(splice(llama_graph, sae, "model.layers_0.output", error_term=error_term)):
        llama_graph(IDS).logits.logsumexp(-1).mean().backward()
    assert all(p.grad is not None and bool(p.grad.abs().sum() > 0) for p in (sae.W_enc, sae.W_dec, sae.b_enc))
    if error_term:  # the same gradient as SAELens's x̂ + (x − x̂).detach()
        ours = sae.W_enc.grad.clone()
        sae.zero_grad()
        saelens = CustomPatch(custom_op=lambda x: sae(x) + (x - sae(x)).detach())
        with llama_graph.patch({"model.layers_0.output": saelens}):
            llama_graph(IDS).logits.logsumexp(-1).mean().backward()
        assert torch.allclose(ours, sae.W_enc.grad, atol=1e-6)


def test_bad_splices_are_refused_before_any_forward(llama_graph) -> None:
    with pytest.raises(DictionaryShapeError, match="last dimension 128"):
        with llama_graph.patch(splice(llama_graph, _sae(), "model.layers_0.mlp.mul")):
            pass
    with pytest.raises(DictionaryShapeError, match="input width is 32"):
        with llama_graph.patch(splice(llama_graph, Transcoder(32, 40, 64, "relu"), "model.layers_0.mlp.x",
                                      output_node="model.layers_0.mlp.output")):
            pass
    with pytest.raises(NodePathError):
        splice(llama_graph, _sae(), "model.layers_9.output")
    with pytest.raises(DictionaryConfigError, match="outside 0..95"):
        splice(llama_graph, _sae(), "model.layers_0.output", ablate=[96])
    with pytest.raises(DictionaryConfigError, match="name the nodes"):
        splice(llama_graph, Transcoder(64, 40, activation="relu"), "model.layers_0.mlp.x")
    backwards = splice(llama_graph, Transcoder(64, 40, activation="relu"), "model.layers_1.output",
                       output_node="model.layers_0.output")
    with pytest.raises(DictionaryShapeError, match="did not run before"), llama_graph.patch(backwards):
        llama_graph(IDS)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_float32_dictionary_in_a_half_precision_model(tiny_llama, dtype: torch.dtype) -> None:
    pg = PatchableGraph(tiny_llama.to(dtype), IDS, use_cache=False)
    original = pg(IDS).logits
    s = splice(pg, _sae(), "model.layers_0.output")
    with pg.patch(s):
        assert torch.equal(pg(IDS).logits, original)
    assert s.latents.dtype == torch.float32
    with pg.patch(splice(pg, _sae(), "model.layers_0.output", error_term=False)):
        assert pg(IDS).logits.dtype == dtype


def test_several_dictionaries_at_once(llama_graph) -> None:
    """A transcoder per layer (circuit-tracer's replacement model) and an SAE on the same residual node as a
    transcoder's input: nested pg.patch blocks, exact with the error terms, each recording its own latents."""
    splices = [splice(llama_graph, Transcoder(64, 48, activation="relu", generator=torch.Generator().manual_seed(i)),
                      f"model.layers_{i}.mlp.x", output_node=f"model.layers_{i}.mlp.output") for i in range(2)]
    splices.append(splice(llama_graph, _sae(), "model.layers_0.output"))
    original = llama_graph(IDS).logits
    with llama_graph.patch(splices[0]), llama_graph.patch(splices[1]), llama_graph.patch(splices[2]):
        assert torch.equal(llama_graph(IDS).logits, original)
    assert [tuple(s.latents.shape) for s in splices] == [(3, 6, 48), (3, 6, 48), (3, 6, 96)]
