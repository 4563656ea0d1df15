"""PatchableGraph.prepare: the graphs of a kind of call extracted ahead, on a small example of its class of sizes,
without a warning; a later call of that kind (any batch) runs them and gives the model's output."""

from __future__ import annotations

import warnings

import torch

from gradpatch import PatchableGraph
from gradpatch.testing import tiny_causal_lm


def test_prepare_extracts_a_batched_kind_of_call_ahead_without_a_warning() -> None:
    model = tiny_causal_lm("llama")
    ids = torch.randint(1, 100, (1, 6), generator=torch.Generator().manual_seed(0))
    pg = PatchableGraph(model, ids, use_cache=False)
    batch = ids.expand(5, -1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the extraction warning of a new class of sizes would raise
        pg.prepare(ids.expand(2, -1))
        with torch.no_grad():
            logits = pg(batch).logits
    with torch.no_grad():
        expected = model(batch, use_cache=False).logits
    torch.testing.assert_close(logits, expected)


def test_without_prepare_a_batched_call_warns_that_it_extracts() -> None:
    model = tiny_causal_lm("llama")
    ids = torch.randint(1, 100, (1, 6), generator=torch.Generator().manual_seed(0))
    pg = PatchableGraph(model, ids, use_cache=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad():
            pg(ids.expand(5, -1))
    assert any("extracting graphs" in str(warning.message) for warning in caught)
