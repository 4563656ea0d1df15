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
    fixed, per_row = memory_per_row(replacement, graph.n_nodes, graph.rows.shape[0])
    assert fixed == measure_saved_bytes(replacement).fixed + 2 * 4 * graph.rows.numel()  # the CPU holds the rows, twice
    assert per_row > 4 * graph.n_nodes
    with pytest.raises(MemoryBoundError, match=f"holds no row: {graph.rows.shape[0]} rows of {graph.n_nodes} nodes "
                                               f"need {fixed + per_row} bytes"):
        attribute(replacement, max_memory_bytes=fixed + per_row - 1)


def test_batches_under_a_memory_bound_give_the_unbounded_graph(replacement, graph) -> None:
    n, targets = graph.n_nodes, graph.n_features + len(graph.logit_tokens)
    fixed, per_row = memory_per_row(replacement, n, targets)
    bound = fixed + 3 * per_row
    assert plan_batch_size(replacement, n, targets, 32, bound) == 3
    assert plan_batch_size(replacement, n, targets, 2, bound) == 2
    assert plan_batch_size(replacement, n, targets, 32, None) == 32
    bounded = attribute(replacement, batch_size=32, max_memory_bytes=bound)
    torch.testing.assert_close(bounded.rows, graph.rows, rtol=1e-5, atol=1e-6)


def test_feature_chunks_give_the_same_rows(replacement, graph, monkeypatch) -> None:
    monkeypatch.setattr(importlib.import_module("gradpatch.circuits.attribute"), "FEATURE_CHUNK", 7)
    torch.testing.assert_close(attribute(replacement, batch_size=32).rows, graph.rows, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_kept_memory_grows_linearly_with_the_prompt(name) -> None:
    """With SDPA the forward pass keeps per row a fixed number of bytes per token (no [seq, seq] pattern: the frozen
    pattern is kept once, whatever the rows). GPT-2's path is linear in constants alone (frozen layer norms, the
    pattern, parameters), so it keeps nothing per row; Llama's keeps its frozen RMSNorm scales per row."""
    short, long = (measure_saved_bytes(tiny_replacement(name, _prompt(seq))) for seq in (8, 64))
    assert long.per_row == 8 * short.per_row and (short.per_row > 0) == (name == "llama")
    assert short.fixed > 0 and long.fixed > short.fixed


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
