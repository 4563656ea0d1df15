"""The prefix KV cache of the value search: the same logits and gradients as full passes, from each row's split on."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from editors import ContextPrefixes, EditRequest, compute_key, resolve_layer
from editors.passes.prefix_cache import PrefixCache, supports_prefix_cache
from editors.value.batch_objective import BatchValueObjective
from gradpatch import AddPatch, PatchableGraph
from gradpatch.testing import byte_level_tokenizer, tiny_gpt2, tiny_llama

NODES = {"llama": "model.layers_0.mlp.down_proj", "gpt2": "transformer.h_0.mlp.c_proj"}
TEMPLATES = ContextPrefixes(prefixes=("", "The river flows. ", "I think you know. "))
REQUESTS = [
    EditRequest("The river flows into the sea near {}", "the old town", "Rome"),
    EditRequest("{} is where we stay", "Madrid", "Berlin"),  # subject at position 0 in the empty-prefix prompt
    EditRequest("The capital of {} is", "France", "London"),
]


def _graph(kind: str):
    tok = byte_level_tokenizer()
    model = (tiny_llama if kind == "llama" else tiny_gpt2)(len(tok))
    return tok, PatchableGraph(model, torch.randint(0, len(tok), (2, 6)), use_cache=False).eval()


@pytest.mark.parametrize("kind", sorted(NODES))
def test_suffix_after_cached_prefix_equals_full_pass_with_patch(kind):
    _, pg = _graph(kind)
    node = NODES[kind] + ".output"
    generator = torch.Generator().manual_seed(0)
    # Prefix lengths 5, 0 (split at the first token) and 8; suffix lengths 7, 4 and 1 (pads on both sides).
    sequences = [torch.randint(1, 200, (n,), generator=generator).tolist() for n in (12, 4, 9)]
    splits = [5, 0, 8]
    values = torch.randn(3, 32, generator=generator)
    full = []
    for i, (sequence, split) in enumerate(zip(sequences, splits)):
        with pg.patch({node: AddPatch(value=values[i : i + 1], slice=(torch.arange(1), torch.tensor([split])))}):
            full.append(pg(torch.tensor([sequence]), use_cache=False).logits[0, split:])
    cache = PrefixCache(pg, pad=0, max_tokens=10)  # 10 tokens a pass: the two prefixes are computed apart
    cache.fill(["a", "b", "c"], [s[:k] for s, k in zip(sequences, splits)])
    assert len(cache) == 3
    inputs = cache.inputs(["a", "b", "c"], [s[k:] for s, k in zip(sequences, splits)])
    assert inputs["attention_mask"].shape == (3, 8 + 7)
    assert inputs["position_ids"][0].tolist() == list(range(5, 12))
    with pg.patch({node: AddPatch(value=values, slice=(torch.arange(3), torch.zeros(3, dtype=torch.long)))}):
        cached = pg(**inputs).logits
    for i, expected in enumerate(full):
        torch.testing.assert_close(cached[i, : len(expected)], expected, rtol=1e-5, atol=1e-5)
    only_empty = cache.inputs(["b"], [sequences[1]])  # no row has a prefix: a plain pass, no cache
    assert cache.cache_name not in only_empty and only_empty["use_cache"] is False
    with pg.patch({node: AddPatch(value=values[1:2], slice=(torch.arange(1), torch.zeros(1, dtype=torch.long)))}):
        torch.testing.assert_close(pg(**only_empty).logits[0], full[1], rtol=1e-5, atol=1e-5)
    cache.discard(["b", "missing"])
    assert len(cache) == 2
    with pytest.raises(KeyError):
        cache.inputs(["b"], [[1, 2]])
    with pytest.raises(ValueError, match="at least one token"):
        cache.inputs(["a"], [[]])


@pytest.mark.parametrize("kind", sorted(NODES))
def test_batched_objective_with_prefix_cache_has_the_full_passes_loss_and_gradient(kind):
    tok, pg = _graph(kind)
    layer = resolve_layer(pg, NODES[kind])
    v0 = torch.stack([layer.forward_value(compute_key(pg, tok, layer, r.prompt, r.subject, TEMPLATES))
                      for r in REQUESTS]).detach()
    delta = torch.randn(v0.shape, generator=torch.Generator().manual_seed(1)) * 0.5
    results = {}
    for prefix_cache in (False, True):
        objective = BatchValueObjective(pg, tok, layer, REQUESTS, TEMPLATES, v0, prefix_cache=prefix_cache)
        assert (objective.prefix_cache is not None) == prefix_cache
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            objective.loss(torch.zeros_like(v0), [0, 1, 2])  # the KL reference, at δ = 0
            step = delta.clone().requires_grad_()
            terms = objective.loss(step, [2, 0, 1])
        # The search's own calls extract graphs silently (they are not calls the user made).
        assert not [w for w in caught if "extracting graphs" in str(w.message)]
        terms["loss"].sum().backward()
        results[prefix_cache] = (terms, step.grad)
        if prefix_cache:
            assert len(objective.prefix_cache) == sum(len(objective.prompts[f].sequences) for f in range(3))
    (full, full_grad), (cached, cached_grad) = results[False], results[True]
    assert float(full["kl"].detach().abs().max()) > 0  # δ moved the KL prompts' predictions: a non-trivial comparison
    for name in ("loss", "nll", "kl", "target_prob"):
        torch.testing.assert_close(cached[name], full[name], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cached_grad, full_grad, rtol=1e-4, atol=1e-6)


def test_models_without_a_cache_argument_run_full_passes():
    class Plain(nn.Module):
        def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
            return input_ids.float()

    plain = Plain()
    assert not supports_prefix_cache(plain)
    assert supports_prefix_cache(_graph("llama")[1])
    with pytest.raises(ValueError, match="prefix_cache=False"):
        PrefixCache(plain, pad=0, max_tokens=10)


@pytest.mark.parametrize("kind", sorted(NODES))
def test_rows_beginning_alike_share_their_first_tokens_and_keep_their_own_states(kind, monkeypatch):
    _, pg = _graph(kind)
    generator = torch.Generator().manual_seed(1)
    start = torch.randint(1, 200, (6,), generator=generator).tolist()
    # Three rows behind the same six tokens (one is exactly them), one other row.
    prefixes = [start + [7, 8, 9], start, start + [11], torch.randint(1, 200, (5,), generator=generator).tolist()]
    shared = PrefixCache(pg, pad=0, max_tokens=12)  # 12 tokens a pass: the rows after the shared ones apart
    calls: list[tuple[int, ...]] = []
    forward = pg.forward
    monkeypatch.setattr(pg, "forward", lambda *a, **k: calls.append(tuple(k["input_ids"].shape)) or forward(*a, **k))
    shared.fill(["a", "b", "c", "d"], prefixes)
    monkeypatch.undo()
    # The six shared tokens once, then rows a and c on them (3 and 1 tokens), and the other row alone.
    assert sorted(calls) == [(1, 1), (1, 3), (1, 5), (1, 6)]
    alone = PrefixCache(pg, pad=0, max_tokens=12)
    for key, prefix in zip("abcd", prefixes):
        alone.fill([key], [prefix])
    suffixes = [[3, 4], [5], [6, 7, 8], [9, 10]]
    with torch.no_grad():
        got = pg(**shared.inputs(list("abcd"), suffixes)).logits
        expected = pg(**alone.inputs(list("abcd"), suffixes)).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    # The six shared tokens are held once: 6 + 3 + 1 + 5 tokens' states, against 9 + 6 + 7 + 5 held row by row.
    assert alone.nbytes() % 27 == 0 and shared.nbytes() == alone.nbytes() // 27 * 15
    shared.discard(["b"])
    assert len(shared) == 3
    shared.discard(["a", "c", "d"])
    assert shared.nbytes() == alone.nbytes() // 27 * 6  # the shared tokens' states stay while the cache lives
