"""transformers models call attention in the graph as they do in eager mode (gradpatch.optional.transformers)."""

from __future__ import annotations

from collections import Counter

import torch
from torch.profiler import ProfilerActivity, profile

from gradpatch import PatchableGraph


def _aten_counts(fn) -> Counter:
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return Counter(event.name for event in prof.events() if event.name.startswith("aten::"))


def test_no_mask_means_causal_sdpa_as_in_eager(tiny_llama, token_ids):
    pg = PatchableGraph(tiny_llama, token_ids, use_cache=False)
    code = pg.graph.model.layers_0.self_attn._code
    assert "attn_mask = None" in code and "is_causal = True" in code and "enable_gqa = True" in code
    eager = _aten_counts(lambda: tiny_llama(token_ids, use_cache=False))
    graph = _aten_counts(lambda: pg(token_ids, use_cache=False))
    more = {name: (eager[name], count) for name, count in graph.items() if count > eager[name]}
    assert not more, f"the graph runs aten ops eager mode does not: {more}"
    assert torch.equal(pg(token_ids, use_cache=False).logits, tiny_llama(token_ids, use_cache=False).logits)


def test_position_ids_from_the_caller_keep_the_general_mask(tiny_llama, token_ids):
    positions = torch.arange(7).expand(2, 7)
    pg = PatchableGraph(tiny_llama, token_ids, position_ids=positions, use_cache=False)
    packed = torch.tensor([[0, 1, 2, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5, 6]])  # two sequences packed in row 0
    torch.testing.assert_close(pg(token_ids, position_ids=packed, use_cache=False).logits,
                               tiny_llama(token_ids, position_ids=packed, use_cache=False).logits)
