"""Gradient attribution: the batched exact sweep against one-at-a-time patching, AtP against the exact sweep where the
metric is linear in the patched activation, AtP-IG's completeness along the interpolated embeddings, the metrics, and
the errors for bad input."""

from __future__ import annotations

import pytest
import torch

from gradpatch import testing
from gradpatch import PatchableGraph, ProbePatch, ReplacePatch
from gradpatch.attribution import (
    AttributionError,
    PromptBatch,
    answer_probability,
    atp,
    detect_family,
    exact_sweep,
    kl_to_clean,
    prompt_batch,
    resolve_nodes,
)
from gradpatch.errors import NonFiniteError
from gradpatch.layouts import detect_layout
from gradpatch.testing import random_prompt_batch

KW = {"use_cache": False}


def _one_at_a_time(pg: PatchableGraph, batch: PromptBatch, result, direction: str) -> list[float]:
    """Each unit patched alone with a ReplacePatch slice, one forward per unit."""
    base, source = (batch.clean, batch.corrupted) if direction == "noise" else (batch.corrupted, batch.clean)
    nodes = {n.path: n for n in resolve_nodes(pg, sorted({s.kind for s in result.scores}))}
    with torch.no_grad():
        base_logits = pg(base, use_cache=False).logits[:, -1]
        base_m = (base_logits.gather(1, batch.answer[:, None]) - base_logits.gather(1, batch.foil[:, None])).mean()
        effects = []
        for score in result.scores:
            node = nodes[score.node]
            probe = ProbePatch()
            with pg.patch({score.node: probe}):
                pg(source, use_cache=False)
            features = slice(None) if score.head is None else slice(score.head * node.head_dim,
                                                                    (score.head + 1) * node.head_dim)
            index = (slice(None), score.position, features)
            with pg.patch({score.node: ReplacePatch(value=probe.activation[index], slice=index)}):
                logits = pg(base, use_cache=False).logits[:, -1]
            m = (logits.gather(1, batch.answer[:, None]) - logits.gather(1, batch.foil[:, None])).mean()
            effects.append(float(m - base_m))
    return effects


@pytest.mark.parametrize("direction", ["noise", "denoise"])
def test_the_batched_sweep_equals_one_at_a_time_patching(gpt2_graph, direction):
    batch = random_prompt_batch()
    result = exact_sweep(gpt2_graph, batch, ["heads", "mlp"], positions=[2, 5], direction=direction, batch_size=15,
                         forward_kwargs=KW)
    # 2 layers x 2 positions x (4 heads + 1 mlp) = 20 units, 5 variants of 3 rows per pass: 2 recordings, 1 pass
    # filling the base run's KV cache, 2 checks of it (from position 2 and from 5), then 2 passes of the 4 tokens from
    # position 2 and 2 passes of the last token (no whole-prompt pass: the shared blocks need no check)
    assert len(result.scores) == 20 and result.forward == 2 + 1 + 2 + 4
    assert result.forward_tokens == 2 * 6 + 6 + (4 + 1) + 2 * 4 + 2 * 1
    expected = _one_at_a_time(gpt2_graph, batch, result, direction)
    torch.testing.assert_close(torch.tensor([s.score for s in result.scores]), torch.tensor(expected),
                               atol=1e-5, rtol=1e-4)
    assert max(abs(e) for e in expected) > 1e-4  # the patches do change the metric
    whole = exact_sweep(gpt2_graph, batch, ["heads", "mlp"], positions=[2, 5], direction=direction, batch_size=15,
                        forward_kwargs=KW, share_prefix=False)  # every variant runs all blocks: the same scores
    torch.testing.assert_close(torch.tensor([s.score for s in whole.scores]), torch.tensor(expected),
                               atol=1e-5, rtol=1e-4)


def test_the_sweep_on_llama_residual_stream_matches_one_at_a_time(llama_graph):
    batch = random_prompt_batch()
    result = exact_sweep(llama_graph, batch, "resid", batch_size=7, forward_kwargs=KW)  # 2 variants, 1 in the last
    assert [(s.layer, s.position) for s in result.scores[:3]] == [(0, 0), (0, 1), (0, 2)]
    expected = _one_at_a_time(llama_graph, batch, result, "noise")
    torch.testing.assert_close(torch.tensor([s.score for s in result.scores]), torch.tensor(expected),
                               atol=1e-5, rtol=1e-4)
    # the residual stream after the last block at the last position carries all of the corrupted run's metric
    last = result.score_map()[("model.layers_1.output", 5, None)]
    assert last == pytest.approx(result.metric_corrupted - result.metric_clean, abs=1e-5)


@pytest.mark.parametrize("graph", ["llama_graph", "gpt2_graph"])
@pytest.mark.parametrize("direction", ["noise", "denoise"])
def test_atp_is_exact_where_the_metric_is_linear_in_the_activation(graph, direction, request):
    """The logit difference is linear in the unembedding's input, so the first-order estimate is exact there."""
    pg = request.getfixturevalue(graph)
    batch = random_prompt_batch()
    exact = exact_sweep(pg, batch, ["lm_head.input"], direction=direction, forward_kwargs=KW)
    estimate = atp(pg, batch, ["lm_head.input"], direction=direction, forward_kwargs=KW)
    assert (estimate.forward, estimate.backward) == (2, 1)
    x = torch.tensor([s.score for s in exact.scores])
    y = torch.tensor([s.score for s in estimate.scores])
    torch.testing.assert_close(y, x, atol=1e-5, rtol=1e-4)
    assert abs(float(x[-1])) > 1e-3 and bool((x[:-1].abs() < 1e-6).all())  # only the last position matters


def test_atp_on_heads_tracks_the_exact_sweep(gpt2_graph):
    batch = random_prompt_batch()
    exact = exact_sweep(gpt2_graph, batch, "heads", forward_kwargs=KW)
    estimate = atp(gpt2_graph, batch, "heads", forward_kwargs=KW)
    assert [(s.node, s.position, s.head) for s in exact.scores] == [
        (s.node, s.position, s.head) for s in estimate.scores]
    x = torch.tensor([s.score for s in exact.scores])
    y = torch.tensor([s.score for s in estimate.scores])
    assert float(torch.corrcoef(torch.stack([x, y]))[0, 1]) > 0.8
    assert exact.metric_clean == pytest.approx(estimate.metric_clean, abs=1e-5)


@pytest.mark.parametrize("graph", ["llama_graph", "gpt2_graph"])
@pytest.mark.parametrize("direction", ["noise", "denoise"])
def test_atp_ig_with_one_step_is_atp_and_its_embedding_scores_add_up_to_the_whole_change(graph, direction, request):
    pg = request.getfixturevalue(graph)
    batch = random_prompt_batch()
    plain = atp(pg, batch, "mlp", direction=direction, forward_kwargs=KW)
    one = atp(pg, batch, "mlp", direction=direction, steps=1, forward_kwargs=KW)  # k = m = 1: the base run's gradient
    assert one.method == "atp-ig" and (one.forward, one.backward) == (2, 1)
    torch.testing.assert_close(torch.tensor([s.score for s in one.scores]),
                               torch.tensor([s.score for s in plain.scores]))
    # Completeness: AtP-IG integrates the gradient along the interpolated token embeddings, so the embedding units'
    # scores add up to the whole base → source change of the metric, up to the Riemann sum's error, which falls as 1/m
    change = (plain.metric_corrupted - plain.metric_clean) * (1 if direction == "noise" else -1)
    embed = [detect_family(pg).embed]
    error = {m: abs(sum(s.score for s in atp(pg, batch, embed, direction=direction, steps=m,
                                             forward_kwargs=KW).scores) - change) for m in (16, 64, 256)}
    assert error[64] < error[16] / 3 and error[256] < error[64] / 3 and error[256] < 0.05 * abs(change), (change, error)


def test_metrics(llama_graph):
    batch = random_prompt_batch()
    with torch.no_grad():
        clean_logits = llama_graph(batch.clean, use_cache=False).logits[:, -1]
    kl = kl_to_clean(clean_logits)
    result = exact_sweep(llama_graph, batch, "resid", kl, positions=[5], forward_kwargs=KW)
    assert result.metric_clean == pytest.approx(0.0, abs=1e-6) and result.metric_corrupted > 0
    assert all(s.score >= -1e-6 for s in result.scores)  # a KL never goes below the clean run's 0
    prob = exact_sweep(llama_graph, batch, "mlp", answer_probability, positions=[5], forward_kwargs=KW)
    assert 0 < prob.metric_clean < 1


def test_bad_nodes_metrics_and_positions_fail_before_any_forward(llama_graph, monkeypatch):
    batch = random_prompt_batch()

    def no_forward(*args, **kwargs):
        raise AssertionError("a forward pass ran")

    detect_layout(llama_graph)  # the layout's identities are verified on one forward pass, once per graph
    monkeypatch.setattr(llama_graph, "forward", no_forward)
    with pytest.raises(AttributionError, match="unknown node kind or NodePath 'attn'.*resid, heads, mlp"):
        atp(llama_graph, batch, "attn", forward_kwargs=KW)
    with pytest.raises(AttributionError, match="model.layers_0.mlp.outptu"):
        exact_sweep(llama_graph, batch, ["model.layers_0.mlp.outptu"], forward_kwargs=KW)
    with pytest.raises(AttributionError, match="not a \\[batch, seq, width\\] tensor"):
        atp(llama_graph, batch, ["model.layers_0.self_attn.output"], forward_kwargs=KW)
    with pytest.raises(AttributionError, match="not a scalar"):
        atp(llama_graph, batch, "mlp", lambda logits, b: logits[:, 0], forward_kwargs=KW)
    with pytest.raises(AttributionError, match="positions \\[9\\]"):
        exact_sweep(llama_graph, batch, "mlp", positions=[9], forward_kwargs=KW)
    with pytest.raises(AttributionError, match="direction 'sideways'"):
        atp(llama_graph, batch, "mlp", direction="sideways", forward_kwargs=KW)
    with pytest.raises(AttributionError, match="steps=-1: give 0 \\(AtP\\) or the number of AtP-IG"):
        atp(llama_graph, batch, "mlp", steps=-1, forward_kwargs=KW)


def test_a_non_finite_gradient_names_the_node(llama_graph):
    def bad(logits: torch.Tensor, batch: PromptBatch) -> torch.Tensor:
        return torch.sqrt(logits.sum() * 0)  # finite value (0), infinite derivative

    with pytest.raises(NonFiniteError, match="model.layers_0.mlp.output"):
        atp(llama_graph, random_prompt_batch(), "mlp", bad, forward_kwargs=KW)


def test_prompt_records_of_different_lengths_or_multi_token_answers_are_refused():
    tokenizer = testing.byte_level_tokenizer()
    good = {"clean": "The capital of France is", "corrupted": "The capital of Spain is", "answer": " Paris",
            "foil": " Rome"}
    batch = prompt_batch(tokenizer, [good])
    assert batch.clean.shape == batch.corrupted.shape and batch.answer.shape == (1,)
    with pytest.raises(AttributionError, match="clean prompt is \\d+ tokens and the corrupted one \\d+"):
        prompt_batch(tokenizer, [{**good, "corrupted": "The capital of Rome is"}])
    with pytest.raises(AttributionError, match="line 2 is \\d+ tokens but line 1 is \\d+"):
        prompt_batch(tokenizer, [good, {**good, "clean": "The capital of Spain is a city",
                                        "corrupted": "The capital of Spain is a city"}])
    with pytest.raises(AttributionError, match="line 1: the answer ' London' is \\d+ tokens"):
        prompt_batch(tokenizer, [{**good, "answer": " London"}])
    with pytest.raises(AttributionError, match="missing or non-string fields \\['foil'\\]"):
        prompt_batch(tokenizer, [{k: v for k, v in good.items() if k != "foil"}])
