"""Editing one expert of a mixture-of-experts block (editors.layers.experts): ROME and MEMIT write a slice ``[e]`` of the
fused ``experts.down_proj``, leave every other expert and parameter bit-identical, and restore exactly."""

from __future__ import annotations

import pytest
import torch

from editors import MEMIT, ROME, ContextPrefixes, EditRequest
from editors.config import MEMITConfig, ROMEConfig
from editors.errors import EditError, LayerKindError
from editors.layers.experts import ExpertLayer, top_expert
from editors.layers import resolve_layer
from editors.passes.scoring import mean_target_logprobs
from editors.statistics import Corpus
from editors.statistics.keys import context_activations, subject_first_activations
from gradpatch import PatchableGraph
from gradpatch.model_io import wrapped_model
from gradpatch.testing import TOY_SENTENCES, byte_level_tokenizer, tiny_causal_lm

FUSED = "model.layers_0.mlp.experts.down_proj"
PARAMETER = "model.layers.0.mlp.experts.down_proj"
# As in test_rome_pipeline: the toy fact ends with its subject, so the edited value reaches the next-token logits.
REQUEST = EditRequest(prompt="The river flows into the sea near {}", subject="the old town", target_new="Rome",
                      target_true="Paris")
SETTINGS = dict(n_samples=32, max_length=64, use_cache=False, progress=False, steps=25, clamp_factor=500.0,
                context_length_params=((5, 4),))
CORPUS = Corpus(name="toy", texts=list(TOY_SENTENCES) * 4)


def _graph(family: str, **config: int) -> tuple[PatchableGraph, object]:
    tok = byte_level_tokenizer()
    # init 0.3 (as tiny_llama): transformers' 0.02 gives a near-uniform model that no edit visibly moves
    model = tiny_causal_lm(family, vocab_size=len(tok), initializer_range=0.3, **config)
    return PatchableGraph(model, torch.randint(0, len(tok), (2, 6)), use_cache=False).eval(), tok


def _probabilities(pg: PatchableGraph, tok: object) -> list[float]:
    """P(target_new), P(target_true) after the rewrite prompt."""
    forward = lambda ids: pg(ids, use_cache=False)  # noqa: E731
    texts, targets = [REQUEST.text] * 2, [REQUEST.target_new, REQUEST.target_true]
    return mean_target_logprobs(forward, tok, texts, targets).exp().tolist()


def _parameters(pg: PatchableGraph) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in wrapped_model(pg).named_parameters()}


def _changed(pg: PatchableGraph, before: dict[str, torch.Tensor]) -> list[str]:
    return [name for name, p in wrapped_model(pg).named_parameters() if not torch.equal(p, before[name])]


def _subject_expert(pg: PatchableGraph, tok: object) -> int:
    fused = resolve_layer(pg, FUSED)
    hidden = context_activations(pg, tok, [fused.input_node], [(REQUEST.prompt, REQUEST.subject)],
                                 ContextPrefixes(("",)))[0][0]
    return top_expert(fused, hidden)


@pytest.mark.parametrize("family, named", [("qwen3_moe", False), ("qwen3_moe", True), ("mixtral", False)])
def test_rome_edits_one_expert_and_restores_bit_identical(family: str, named: bool) -> None:
    pg, tok = _graph(family)
    expert = _subject_expert(pg, tok)
    node = f"{FUSED}[{expert}]" if named else FUSED
    rome = ROME(pg, tok, node, ROMEConfig(**SETTINGS), corpus=CORPUS)
    before, params = _probabilities(pg, rome.tokenizer), _parameters(pg)
    edit = rome.edit(REQUEST)
    after = _probabilities(pg, rome.tokenizer)
    assert edit.node == f"{FUSED}[{edit.info['expert']}]" and 0 < edit.info["router_weight"] <= 1
    if named:
        assert edit.info["expert"] == expert
    assert after[0] > before[0] + 0.1 and after[0] > after[1], (before, after)
    assert _changed(pg, params) == [PARAMETER]  # router, gate_up_proj, every other layer untouched
    fused = dict(wrapped_model(pg).named_parameters())[PARAMETER]
    for e in range(fused.shape[0]):
        assert torch.equal(fused[e], params[PARAMETER][e]) is (e != edit.info["expert"])
    edit.restore(pg)
    assert _changed(pg, params) == []
    assert _probabilities(pg, rome.tokenizer) == before


def test_expert_statistics_weigh_the_routed_tokens() -> None:
    pg, tok = _graph("qwen3_moe")
    layer = resolve_layer(pg, f"{FUSED}[1]")
    assert isinstance(layer, ExpertLayer) and (layer.d_in, layer.d_out) == (16, 32)
    stats = ROME(pg, tok, f"{FUSED}[1]", ROMEConfig(**SETTINGS), corpus=CORPUS).statistics()
    assert stats.input_node == f"{FUSED}[1].input" and stats.matrix.shape == (16, 16)
    assert bool(torch.linalg.eigvalsh(stats.matrix).min() > 0)
    hidden = torch.randn(5, 32)
    weights = layer.key_weights(hidden)
    assert set(weights.tolist()) <= {1.0, 0.01} and torch.equal(weights == 1.0, layer.routing_weight(hidden) > 0)


def test_expert_index_out_of_range_is_refused() -> None:
    pg, tok = _graph("qwen3_moe")
    for index in (4, -1):
        with pytest.raises(LayerKindError, match=r"holds 4 experts; expert .* out of range: name one of 0\.\.3"):
            ROME(pg, tok, f"{FUSED}[{index}]", ROMEConfig(**SETTINGS))
    with pytest.raises(LayerKindError, match=r"no expert is chosen: name one, e.g. '.*down_proj\[0\]'"):
        _ = resolve_layer(pg, FUSED).weight


def test_an_expert_the_subject_never_reaches_is_refused_without_a_write() -> None:
    pg, tok = _graph("qwen3_moe", num_experts_per_tok=1)  # top-1 of 4: the subject's key prompts miss an expert
    rome = ROME(pg, tok, FUSED, ROMEConfig(**SETTINGS), corpus=CORPUS)
    fused = resolve_layer(pg, FUSED)
    hidden = torch.cat([context_activations(pg, rome.tokenizer, [fused.input_node], [(REQUEST.prompt, REQUEST.subject)],
                                            rome.templates())[0][0],
                        subject_first_activations(pg, rome.tokenizer, [fused.input_node], [REQUEST.subject])[0][0]])
    never = [e for e, w in enumerate(fused.routes(hidden).amax(dim=0).tolist()) if w == 0]
    assert never, "the tiny model routes the subject to every expert: pick another seed"
    params = _parameters(pg)
    named = ROME(pg, tok, f"{FUSED}[{never[0]}]", ROMEConfig(**SETTINGS), corpus=CORPUS)
    with pytest.raises(EditError, match="never sends .* edit an expert it routes to"):
        named.edit(REQUEST)
    assert _changed(pg, params) == []


def test_memit_writes_the_named_expert() -> None:
    pg, tok = _graph("qwen3_moe")
    expert = _subject_expert(pg, tok)
    memit = MEMIT(pg, tok, [f"{FUSED}[{expert}]"], MEMITConfig(**SETTINGS), corpus=CORPUS)
    before, params = _probabilities(pg, memit.tokenizer), _parameters(pg)
    batch = memit.edit([REQUEST])
    after = _probabilities(pg, memit.tokenizer)
    assert after[0] > before[0] + 0.05 and after[0] > after[1], (before, after)
    assert _changed(pg, params) == [PARAMETER]
    fused = dict(wrapped_model(pg).named_parameters())[PARAMETER]
    assert [torch.equal(fused[e], params[PARAMETER][e]) for e in range(4)] == [e != expert for e in range(4)]
    batch.restore(pg)
    assert _changed(pg, params) == []
    with pytest.raises(LayerKindError, match=r"MEMIT writes each layer's update into one expert: name it"):
        MEMIT(pg, tok, [FUSED], MEMITConfig(**SETTINGS))


def test_expert_edit_as_patches_matches_the_weight_write() -> None:
    pg, tok = _graph("qwen3_moe")
    rome = ROME(pg, tok, FUSED, ROMEConfig(**SETTINGS), corpus=CORPUS)
    edit = rome.compute(REQUEST)
    ids = torch.tensor([list(rome.tokenizer(REQUEST.text)["input_ids"])])
    with torch.no_grad():
        edit.apply(pg)
        written = pg(ids, use_cache=False).logits
        edit.restore(pg)
        edit.apply(pg, mode="patch")
        patched = pg(ids, use_cache=False).logits
        edit.restore(pg)
    torch.testing.assert_close(patched, written, rtol=1e-4, atol=1e-4)
