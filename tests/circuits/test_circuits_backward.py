"""Attribution graphs built from one forward pass and many backward passes (gradpatch.circuits.backward) under a
memory bound: the bound's batches and the feature chunks give the unbounded graph, a bound too small is refused,
what the forward pass keeps does not depend on the batch, the forward passes of the prompt's first positions give
the rows of the whole prompt's, and the parameters' ``requires_grad`` is restored. The graph's exactness is
tests/circuits/test_circuits.py's."""

from __future__ import annotations

import copy
import importlib

import pytest
import torch
from test_circuits import tiny_replacement

from gradpatch.circuits import AttributionGraph, CircuitError, MemoryBoundError, ReplacementModel, attribute
from gradpatch.circuits.attribute import memory_per_row, plan_batch_size
from gradpatch.circuits.backward import RetainedForward, Target, measure_saved_bytes
from gradpatch.circuits.batches import causal, choose_lengths, plan_batches
from gradpatch.circuits.edges import FEATURE_CHUNK


def _prompt(seq: int) -> torch.Tensor:
    return torch.randint(0, 100, (1, seq), generator=torch.Generator().manual_seed(3))


def _assert_rows_close(rows: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal up to float rounding: the backward passes' shapes (rows, positions) change the kernels' summation
    order, within 1e-6 of the largest |A|."""
    torch.testing.assert_close(rows, expected, rtol=1e-5, atol=1e-6 * float(expected.abs().max()))


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def replacement(request) -> ReplacementModel:
    return tiny_replacement(request.param, _prompt(7))


@pytest.fixture(scope="module")
def graph(replacement) -> AttributionGraph:
    return attribute(replacement, batch_size=32)


def test_a_bound_too_small_for_one_row_is_refused(replacement, graph) -> None:
    fixed, per_row = memory_per_row(replacement, graph.n_nodes, graph.rows.shape[0])
    saved = measure_saved_bytes(replacement)
    chunk = FEATURE_CHUNK * max(s.transcoder.d_out for s in replacement.layers.values()) * 4
    patterns = sum(pattern.untyped_storage().nbytes() for _, pattern in replacement.pattern_values)
    assert patterns > 0  # a shorter forward pass's cut copies of the recorded patterns, at most their size
    assert fixed == 2 * saved.kept + saved.transient + patterns + chunk + 2 * 4 * graph.rows.numel()  # rows, twice
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
    _assert_rows_close(bounded.rows, graph.rows)


def test_feature_chunks_give_the_same_rows(replacement, graph, monkeypatch) -> None:
    monkeypatch.setattr(importlib.import_module("gradpatch.circuits.edges"), "FEATURE_CHUNK", 7)
    _assert_rows_close(attribute(replacement, batch_size=32).rows, graph.rows)


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_kept_memory_does_not_depend_on_the_batch(name) -> None:
    """The forward pass runs one row whatever the batch (the backward passes are vectorised over the rows), and
    keeps nothing beyond the replacement model's recording (every nonlinearity frozen or replaced: the attention
    patterns the live values are multiplied by are the recording's own, which the measure leaves out), its transient
    saves growing with the prompt."""
    short, long = (measure_saved_bytes(tiny_replacement(name, _prompt(seq))) for seq in (8, 64))
    assert short.kept == long.kept == 0 and long.transient > short.transient > 0
    replacement = tiny_replacement(name, _prompt(8))
    assert RetainedForward(replacement, 64).embeddings.shape[0] == 1


def test_shorter_forward_passes_give_the_rows_of_the_whole_prompt(replacement, graph, monkeypatch) -> None:
    """Each feature row from a forward pass of the first positions up to its own equals its row from the whole
    prompt's forward pass; the graph built with them (the default) equals the one built without."""
    assert causal(replacement)
    whole = RetainedForward(replacement, 64)
    targets = [Target("feature", int(l), int(p), int(f)) for l, p, f in graph.active_features.tolist()]
    for target in targets[::5]:
        shorter = RetainedForward(replacement, 64, max(target.position + 1, 2))
        gradients, embed = shorter.gradients([target])
        full_gradients, full_embed = whole.gradients([target])
        length = shorter.length
        assert set(gradients) == set(full_gradients)
        assert not full_embed[:, length:].any()
        for ours, full in ((embed, full_embed), *((gradients[l], full_gradients[l]) for l in gradients)):
            _assert_rows_close(ours, full[:, :length])
    monkeypatch.setattr(importlib.import_module("gradpatch.circuits.attribute"), "causal", lambda model: False)
    _assert_rows_close(attribute(replacement, batch_size=32).rows, graph.rows)


def test_the_plan_serves_every_target_once_from_a_forward_pass_that_reaches_it() -> None:
    generator = torch.Generator().manual_seed(0)
    seq = 64
    targets = [Target("feature", layer, position, feature) for layer in range(30) for position in range(1, seq)
               for feature in range(int(torch.randint(0, 4, (1,), generator=generator)))]
    targets += [Target("logit", 0, 0, token) for token in range(5)]
    lengths = choose_lengths(targets, seq, 16)
    assert lengths[-1] == seq and lengths == sorted(set(lengths)) and len(lengths) > 1 and lengths[0] >= 2
    assert choose_lengths(targets[-5:], seq, 16) == [seq]  # the logits alone: the whole prompt
    plan = plan_batches(targets, lengths, 16)
    assert sorted(i for _, rows in plan for i in rows) == list(range(len(targets)))
    for length, rows in plan:
        assert 0 < len(rows) <= 16 and length in lengths
        for i in rows:
            target = targets[i]
            shortest = next(n for n in lengths if n > target.position)
            assert length == (seq if target.kind == "logit" else shortest)
    cost = sum(len(rows) * max(targets[i].layer for i in rows) * length for length, rows in plan)
    whole = sum(len(rows) * max(targets[i].layer for i in rows) * seq for _, rows in plan_batches(targets, [seq], 16))
    assert cost < 0.75 * whole


def test_a_pattern_that_reads_later_positions_is_not_causal(replacement) -> None:
    other = copy.copy(replacement)
    assert other.pattern_values or any(path for path in other.frozen.attention)
    if other.pattern_values:
        other.pattern_values = [(pattern, a0.transpose(-1, -2)) for pattern, a0 in other.pattern_values]
    else:
        other.frozen_values = {path: value.transpose(-1, -2) if path in other.frozen.attention else value
                               for path, value in other.frozen_values.items()}
    assert causal(replacement) and not causal(other)
    other = copy.copy(replacement)
    other.forward_kwargs = {"attention_mask": torch.ones_like(replacement.ids)}
    assert not causal(other)


def test_a_backward_pass_refuses_targets_its_forward_pass_does_not_reach(replacement) -> None:
    shorter = RetainedForward(replacement, 2, 3)
    with pytest.raises(CircuitError, match="features before position 3"):
        shorter.gradients([Target("feature", 1, 3, 0)])
    with pytest.raises(CircuitError, match="logits on the whole prompt"):
        shorter.gradients([Target("logit", 0, 0, 5)])
    with pytest.raises(CircuitError, match="give at most 2"):
        shorter.gradients([Target("feature", 1, 1, 0)] * 3)
    with pytest.raises(CircuitError, match="length=1: give 2 to 7 positions"):
        replacement.run(1, length=1)


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
