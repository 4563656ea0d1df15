"""Rows that begin with the same tokens run those tokens once (editors.passes.shared_prefix): the activations of whole rows,
with the caller's patches on the shared tokens too, and the keys of MEMIT's passes unchanged."""

from __future__ import annotations

import pytest
import torch

import editors.passes.shared_prefix as shared_prefix
from editors import ContextPrefixes, resolve_layer
from editors.passes.prefix_cache import FIRST_PASS_ROWS, MIN_SHARED_TOKENS
from editors.passes.shared_prefix import row_activations
from editors.passes.tokens import common_prefix_length as shared_length, sorted_chunks
from editors.statistics.keys import context_activations
from gradpatch import AddPatch, PatchableGraph
from gradpatch.testing import byte_level_tokenizer, tiny_gpt2, tiny_llama

NODES = {"llama": ("model.layers_1.mlp.down_proj.input", "model.layers_1.output"),
         "gpt2": ("transformer.h_1.mlp.c_proj.x", "transformer.h_1.output")}
TEMPLATES = ContextPrefixes(prefixes=("", "The river flows. ", "I think you know. "))
FACTS = [("{} is the capital of", "Madrid"), ("The river flows into the sea near {}", "the old town"),
         ("People in {} speak", "Lyon"), ("{} was founded by", "Apple")]


def _graph(kind: str):
    tok = byte_level_tokenizer()
    model = (tiny_llama if kind == "llama" else tiny_gpt2)(len(tok))
    pg = PatchableGraph(model, torch.randint(0, len(tok), (2, 6)), use_cache=False)
    return pg.eval(), tok


class _CountingCache(shared_prefix.PrefixCache):
    """A PrefixCache that records the prefixes it computes."""

    filled: list[list[int]] = []

    def fill(self, keys, prefixes):
        type(self).filled += [list(p) for p in prefixes]
        super().fill(keys, prefixes)


def test_shared_length_stops_at_the_first_difference_or_the_limit():
    assert shared_length([[1, 2, 3, 4], [1, 2, 5], [1, 2, 3]], 10) == 2
    assert shared_length([[1, 2, 3, 4], [1, 2, 3, 4, 5]], 3) == 3
    assert shared_length([[7, 2], [1, 2]], 5) == 0


@pytest.mark.parametrize("kind", sorted(NODES))
def test_rows_with_a_shared_prefix_give_the_whole_rows_activations_with_patches_on_the_prefix(kind, monkeypatch):
    pg, tok = _graph(kind)
    monkeypatch.setattr(shared_prefix, "PrefixCache", _CountingCache)
    _CountingCache.filled = []
    head = list(tok("A long shared beginning. ")["input_ids"])
    rows = [head + list(tok(tail)["input_ids"]) for tail in ("Madrid is", "the old town is near", "Lyon")]
    reads = [len(row) - 1 for row in rows]
    node = NODES[kind][0]
    d_model = 32
    # Not a constant vector: GPT-2's LayerNorm would remove it.
    patches = {NODES[kind][1].replace("1.output", "0.output"): AddPatch(value=torch.linspace(-1.0, 1.0, d_model))}
    for patch_map in (None, patches):  # a patch changes the shared tokens too
        expected = row_activations(pg, list(NODES[kind]), rows, reads, tok.pad_token_id, patches=patch_map,
                                   max_tokens=40, share_prefix=False)
        got = row_activations(pg, list(NODES[kind]), rows, reads, tok.pad_token_id, patches=patch_map,
                              max_tokens=40)
        for a, b in zip(got, expected):
            assert a.shape == (3, b.shape[-1])
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert _CountingCache.filled == [head, head]  # one shared pass per call, over the shared beginning
    with_patch = row_activations(pg, [node], rows, reads, tok.pad_token_id, patches=patches)[0]
    assert not torch.allclose(with_patch, row_activations(pg, [node], rows, reads, tok.pad_token_id)[0])


def test_rows_share_nothing_below_the_minimum_or_past_the_first_read(monkeypatch):
    pg, tok = _graph("llama")
    monkeypatch.setattr(shared_prefix, "PrefixCache", _CountingCache)
    _CountingCache.filled = []
    short = [[5, 6, 7, 8, 9], [5, 6, 7, 10, 11]]  # three shared tokens: fewer than the minimum
    assert MIN_SHARED_TOKENS > 3
    row_activations(pg, [NODES["llama"][0]], short, [4, 4], tok.pad_token_id)
    same = [[5, 6, 7, 8, 9, 10], [5, 6, 7, 8, 9, 10, 11]]
    got = row_activations(pg, [NODES["llama"][0]], same, [4, 6], tok.pad_token_id)[0]  # row 0 is read at 4
    assert _CountingCache.filled == [[5, 6, 7, 8]]
    expected = row_activations(pg, [NODES["llama"][0]], same, [4, 6], tok.pad_token_id, share_prefix=False)[0]
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_chunks_by_tokens_with_a_small_first_one():
    assert sorted_chunks([1, 1, 1, 2, 2, 5], 6) == [[0, 1, 2], [3, 4], [5]]
    assert sorted_chunks([1, 1, 1, 2, 2, 5], 6, first_rows=2) == [[0, 1], [2, 3, 4], [5]]
    assert sorted_chunks([9, 9], 6, first_rows=2) == [[0], [1]]


def test_the_first_pass_on_a_shared_prefix_is_small_and_counts_its_tokens(monkeypatch):
    """A first call of a new kind runs twice (gradpatch extracts its graphs on it, through the whole model): it
    carries FIRST_PASS_ROWS rows; every pass's rows × whole width (the shared tokens are in its cache) fit."""
    pg, tok = _graph("llama")
    passes: list[tuple[int, int]] = []
    record = shared_prefix.node_activations

    def recording(pg, nodes, input_ids, **kwargs):
        passes.append((input_ids.shape[0], kwargs.get("attention_mask", input_ids).shape[1]))
        return record(pg, nodes, input_ids, **kwargs)

    monkeypatch.setattr(shared_prefix, "node_activations", recording)
    head = list(tok("A long shared beginning. ")["input_ids"])
    rows = [head + [40 + i, 50, 60] for i in range(9)]
    reads = [len(head)] * len(rows)
    got = row_activations(pg, [NODES["llama"][0]], rows, reads, tok.pad_token_id, max_tokens=4 * len(rows[0]))
    assert [n for n, _ in passes] == [FIRST_PASS_ROWS, 4, 9 - FIRST_PASS_ROWS - 4]
    assert all(n * width <= 4 * len(rows[0]) for n, width in passes)
    expected = row_activations(pg, [NODES["llama"][0]], rows, reads, tok.pad_token_id, share_prefix=False)
    torch.testing.assert_close(got[0], expected[0], rtol=1e-5, atol=1e-5)


def test_context_activations_with_shared_prefixes_equal_whole_rows():
    pg, tok = _graph("llama")
    layer = resolve_layer(pg, "model.layers_1.mlp.down_proj")
    nodes = [layer.input_node, "model.layers_1.output"]
    got = context_activations(pg, tok, nodes, FACTS, TEMPLATES, max_tokens=60)
    expected = context_activations(pg, tok, nodes, FACTS, TEMPLATES, max_tokens=60, share_prefix=False)
    for a, b in zip(got, expected):
        assert a.shape[:2] == (len(FACTS), len(TEMPLATES))
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
