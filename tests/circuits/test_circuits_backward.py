"""Attribution graphs built from one forward pass and many backward passes (gradpatch.circuits.backward) under a
memory bound: the bound's batches and the feature chunks give the unbounded graph, a bound too small is refused,
what the forward pass keeps grows linearly with the prompt, and the parameters' ``requires_grad`` is restored. The
graph's exactness is tests/circuits/test_circuits.py's."""

from __future__ import annotations

import importlib

import pytest
import torch
from test_circuits import tiny_replacement

from gradpatch.circuits import AttributionGraph, MemoryBoundError, ReplacementModel, attribute
from gradpatch.circuits.attribute import memory_per_row, plan_batch_size
from gradpatch.circuits.backward import measure_saved_bytes


def _prompt(seq: int) -> torch.Tensor:
    return torch.randint(0, 100, (1, seq), generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def replacement(request) -> ReplacementModel:
    return tiny_replacement(request.param, _prompt(7))


@pytest.fixture(scope="module")
def graph(replacement) -> AttributionGraph:
    return attribute(replacement, batch_size=32)


def test_a_bound_too_small_for_one_row_is_refused(replacement, graph) -> None:
    fixed, per_row = memory_per_row(replacement, graph.adjacency.shape[0])
    assert fixed >= 4 * graph.adjacency.numel() and per_row > 4 * graph.adjacency.shape[0]  # the CPU holds [n, n]
    with pytest.raises(MemoryBoundError, match=f"holds no row: one row of {graph.adjacency.shape[0]} nodes needs"):
        attribute(replacement, max_memory_bytes=fixed + per_row - 1)


def test_batches_under_a_memory_bound_give_the_unbounded_graph(replacement, graph) -> None:
    n, targets = graph.adjacency.shape[0], graph.n_features + len(graph.logit_tokens)
    fixed, per_row = memory_per_row(replacement, n)
    bound = fixed + 3 * per_row
    assert plan_batch_size(replacement, n, targets, 32, bound) == 3
    assert plan_batch_size(replacement, n, targets, 2, bound) == 2
    assert plan_batch_size(replacement, n, targets, 32, None) == 32
    bounded = attribute(replacement, batch_size=32, max_memory_bytes=bound)
    torch.testing.assert_close(bounded.adjacency, graph.adjacency, rtol=1e-5, atol=1e-6)


def test_feature_chunks_give_the_same_rows(replacement, graph, monkeypatch) -> None:
    monkeypatch.setattr(importlib.import_module("gradpatch.circuits.attribute"), "FEATURE_CHUNK", 7)
    torch.testing.assert_close(attribute(replacement, batch_size=32).adjacency, graph.adjacency, rtol=1e-5,
                               atol=1e-6)


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_kept_memory_grows_linearly_with_the_prompt(name) -> None:
    """With SDPA the forward pass keeps per row a fixed number of bytes per token (no [seq, seq] pattern)."""
    short, long = (measure_saved_bytes(tiny_replacement(name, _prompt(seq))) for seq in (8, 64))
    assert short.per_row > 0 and long.per_row == 8 * short.per_row


def test_parameters_keep_requires_grad(replacement) -> None:
    parameters = list(replacement.pg.wrapped_model.parameters())
    parameters[0].requires_grad_(False)
    try:
        before = [p.requires_grad for p in parameters]
        attribute(replacement, batch_size=64)
        assert [p.requires_grad for p in parameters] == before and any(before)
        assert all(p.requires_grad for s in replacement.layers.values() for p in s.transcoder.parameters())
    finally:
        parameters[0].requires_grad_(True)
