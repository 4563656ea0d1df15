"""The batched value search: the same objective and the same deltas as ROME's one-fact search, many facts per pass."""

from __future__ import annotations

import pytest
import torch

import editors.value.batch_objective as batch_value
from editors import ContextPrefixes, EditRequest, ValueObjective, compute_key, optimize_value, resolve_layer
from editors.passes.capture import node_activations
from editors.passes.scoring import mean_target_logprobs
from editors.passes.selected_logits import logits_at, output_embedding_input_node, target_logprobs_at
from editors.statistics.keys import context_activations
from editors.value.batch_objective import BatchValueObjective
from editors.value.batch_search import optimize_values
from gradpatch import AddPatch, PatchableGraph
from gradpatch.errors import NonFiniteError
from gradpatch.model_io import logits_of
from gradpatch.testing import byte_level_tokenizer, tiny_gpt2, tiny_llama

TEMPLATES = ContextPrefixes(prefixes=("", "The river flows. ", "I think you know. "))
REQUESTS = [
    EditRequest("The river flows into the sea near {}", "the old town", "Rome"),
    EditRequest("I think the answer is {}", "the bridge", "Paris"),
    EditRequest("The capital of {} is", "France", "London"),
    EditRequest("Because it rains, we stay home in {}", "Madrid", "Berlin"),
]
NODES = {"llama": "model.layers_0.mlp.down_proj", "gpt2": "transformer.h_0.mlp.c_proj"}


def _setup(kind: str = "llama"):
    tok = byte_level_tokenizer()
    model = (tiny_llama if kind == "llama" else tiny_gpt2)(len(tok))
    pg = PatchableGraph(model, torch.randint(0, len(tok), (2, 6)), use_cache=False).eval()
    layer = resolve_layer(pg, NODES[kind])
    v0 = torch.stack([layer.forward_value(compute_key(pg, tok, layer, r.prompt, r.subject, TEMPLATES))
                      for r in REQUESTS]).detach()
    return pg, tok, layer, v0


@pytest.mark.parametrize("kind", sorted(NODES))
@pytest.mark.parametrize("max_tokens", [40, 4096])  # one fact per pass, and all four in one pass
@pytest.mark.parametrize("prefix_cache", [True, False])
def test_batched_search_returns_the_one_fact_searches_deltas(kind, max_tokens, prefix_cache, monkeypatch):
    pg, tok, layer, v0 = _setup(kind)
    if max_tokens == 4096:  # all 16 rows in one group: run them as three length buckets (a lone fact's run as one)
        monkeypatch.setattr(batch_value, "MIN_BUCKET_ROWS", 1)
    # A threshold that stops some facts early and not others, so rows freeze at different steps.
    early_stop = 4.0
    singles = [optimize_value(ValueObjective(pg, tok, layer, r, TEMPLATES, v0[i], clamp_factor=500.0), steps=12,
                              early_stop_loss=early_stop) for i, r in enumerate(REQUESTS)]
    objective = BatchValueObjective(pg, tok, layer, REQUESTS, TEMPLATES, v0, clamp_factor=500.0, max_tokens=max_tokens,
                                    prefix_cache=prefix_cache)
    seen: list[int] = []
    batched = optimize_values(objective, steps=12, early_stop_loss=early_stop,
                              callback=lambda step, terms: seen.append(len(terms)))
    groups = len(objective.chunks(range(4)))  # with the cache a row counts only the tokens a step runs
    assert groups == 1 if max_tokens == 4096 else (1 < groups < 4 if prefix_cache else groups == 4)
    assert sorted({s.steps for s in singles}) != [12], "the threshold should stop some facts early"
    for single, many in zip(singles, batched):
        assert many.steps == single.steps
        torch.testing.assert_close(many.delta, single.delta, rtol=1e-4, atol=1e-4)
        assert [h["loss"] for h in many.history] == pytest.approx([h["loss"] for h in single.history], abs=1e-4)
    assert seen[0] == 4 and seen[-1] < 4  # stopped facts leave the batch
    if prefix_cache:  # every fact's prefix states were freed when it stopped
        assert objective.prefix_cache is not None and len(objective.prefix_cache) == 0


def test_first_evaluation_equals_value_objective_terms():
    pg, tok, layer, v0 = _setup()
    objective = BatchValueObjective(pg, tok, layer, REQUESTS, TEMPLATES, v0)
    delta = torch.zeros_like(v0)
    terms = objective.loss(delta, [2, 0, 3])
    for slot, fact in enumerate([2, 0, 3]):
        single = ValueObjective(pg, tok, layer, REQUESTS[fact], TEMPLATES, v0[fact]).loss(torch.zeros(layer.d_out))
        for name in ("loss", "nll", "kl", "target_prob"):
            expected = float(single[name].detach())
            assert float(terms[name][slot].detach()) == pytest.approx(expected, rel=1e-5, abs=1e-6)
    # A fact first seen at a non-zero delta has no KL reference: refused.
    delta[1] = 1.0
    with pytest.raises(ValueError, match="non-zero"):
        objective.loss(delta, [1])


def test_clamp_per_row_and_non_finite_update_named():
    pg, tok, layer, v0 = _setup()
    objective = BatchValueObjective(pg, tok, layer, REQUESTS, TEMPLATES, v0, clamp_factor=2.0)
    delta = torch.ones_like(v0) * 100
    delta[1] = 0.01
    objective.project_(delta)
    norms = delta.norm(dim=-1)
    limit = 2.0 * v0.norm(dim=-1)
    assert torch.allclose(norms[[0, 2, 3]], limit[[0, 2, 3]], rtol=1e-5)
    assert torch.allclose(delta[1], torch.full_like(delta[1], 0.01))
    with pytest.raises(NonFiniteError, match=r"fact \d .*subject"):
        optimize_values(objective, steps=3, lr=1e38, early_stop_loss=0.0)
    with pytest.raises(ValueError, match="finite positive"):
        optimize_values(objective, lr=float("nan"))


@pytest.mark.parametrize("kind", sorted(NODES))
def test_logits_at_equals_indexed_full_logits(kind):
    pg, _, layer, _ = _setup(kind)
    assert output_embedding_input_node(pg) == "lm_head.input"
    ids = torch.randint(0, 300, (3, 9), generator=torch.Generator().manual_seed(0))
    rows, cols = torch.tensor([0, 2, 2, 1]), torch.tensor([8, 0, 5, 3])
    delta = torch.zeros(layer.d_out, requires_grad=True)
    patch = {layer.output_node: AddPatch(value=delta, slice=(slice(None), 1))}
    with pg.patch(patch):
        full = logits_of(pg(ids, use_cache=False))[rows, cols]
    picked = logits_at(pg, ids, rows, cols, patch)
    torch.testing.assert_close(picked, full, rtol=1e-5, atol=1e-5)
    (grad_full,) = torch.autograd.grad(full.sum(), delta)
    (grad_picked,) = torch.autograd.grad(logits_at(pg, ids, rows, cols, patch).sum(), delta)
    torch.testing.assert_close(grad_picked, grad_full, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kind", sorted(NODES))
def test_target_logprobs_at_equals_full_logits_scoring(kind):
    pg, tok, layer, _ = _setup(kind)
    prompts = [r.prompt.format(r.subject) for r in REQUESTS] * 2
    targets = [r.target_new for r in REQUESTS] + ["a much longer target", "x", "Rome", "the sea"]
    patch = {layer.output_node: AddPatch(value=torch.full((layer.d_out,), 0.3), slice=(slice(None), 2))}
    with pg.patch(patch):  # active patches apply to both
        full = mean_target_logprobs(lambda ids: pg(ids, use_cache=False), tok, prompts, targets, batch_size=3)
        picked = target_logprobs_at(pg, tok, prompts, targets, batch_size=3)
    assert picked.shape == (8,) and bool((picked < 0).all())
    torch.testing.assert_close(picked, full, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="one target per prompt"):
        target_logprobs_at(pg, tok, prompts, targets[:2])


def test_context_activations_put_each_fact_and_prefix_in_its_place():
    # The rows run sorted by length (prefixes and prompts of different lengths interleave), then go back in place.
    pg, tok, layer, _ = _setup()
    facts = [(r.prompt, r.subject) for r in REQUESTS]
    keys = context_activations(pg, tok, [layer.input_node], facts, TEMPLATES, max_tokens=50)[0]
    for i, fact in enumerate(facts):
        for j, prefix in enumerate(TEMPLATES.prefixes):
            alone = context_activations(pg, tok, [layer.input_node], [fact], ContextPrefixes(prefixes=(prefix,)))[0]
            torch.testing.assert_close(keys[i, j], alone[0, 0])


def test_context_activations_match_compute_key_and_separate_captures():
    pg, tok, layer, _ = _setup()
    residual = "model.layers_1.output"
    keys, hidden = context_activations(pg, tok, [layer.input_node, residual],
                                       [(r.prompt, r.subject) for r in REQUESTS], TEMPLATES, max_tokens=50)
    assert keys.shape == (4, 3, layer.d_in) and hidden.shape == (4, 3, 32)
    for i, r in enumerate(REQUESTS):
        torch.testing.assert_close(keys[i].mean(0), compute_key(pg, tok, layer, r.prompt, r.subject, TEMPLATES))
    ids = torch.randint(0, 300, (2, 7), generator=torch.Generator().manual_seed(3))
    both = node_activations(pg, [residual, layer.input_node], ids)
    assert torch.equal(both[1], node_activations(pg, [layer.input_node], ids)[0])
    assert torch.equal(both[0], node_activations(pg, [residual], ids)[0])

