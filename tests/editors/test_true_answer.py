"""The value-search term that keeps each fact's true-answer logit: a hinge on its drop, per fact, with gradients."""

from __future__ import annotations

import pytest
import torch

from editors import ContextPrefixes, EditRequest, MEMITConfig, compute_key, resolve_layer
from editors.passes.tokens import encode_prompt_target, format_with_span
from editors.value.batch_objective import BatchValueObjective
from gradpatch import AddPatch, PatchableGraph
from gradpatch.testing import byte_level_tokenizer, tiny_llama

TEMPLATES = ContextPrefixes(prefixes=("", "The river flows. "))
# Prompts ending in a space: the byte-level tokenizer's first target token is then the target's first letter, so the
# true answer's token ("P", "O") differs from the new one's ("L", "R").
REQUESTS = [EditRequest("The capital of {} is ", "France", "London", target_true="Paris"),
            EditRequest("{} was born in ", "the old man", "Rome", target_true="Oslo")]
NODE = "model.layers_0.mlp.down_proj"


def _setup():
    tok = byte_level_tokenizer()
    pg = PatchableGraph(tiny_llama(len(tok)), torch.randint(0, len(tok), (2, 6)), use_cache=False).eval()
    layer = resolve_layer(pg, NODE)
    v0 = torch.stack([layer.forward_value(compute_key(pg, tok, layer, r.prompt, r.subject, TEMPLATES))
                      for r in REQUESTS]).detach()
    return pg, tok, layer, v0


def _true_logits(pg, tok, delta: torch.Tensor) -> torch.Tensor:
    """``[facts, prefixes]``: the true answer's logit where each rewriting prompt's first new-target token is
    predicted, ``delta[f]`` added at the subject's last token of the layer's output (one full pass per prompt)."""
    rows = []
    for f, request in enumerate(REQUESTS):
        true = encode_prompt_target(tok, request.prompt.format(request.subject), request.target_true)
        true_token = true.ids[true.target_start]
        row = []
        for prefix in TEMPLATES.prefixes:
            text, span = format_with_span(request.prompt, request.subject, prefix)
            encoded = encode_prompt_target(tok, text, request.target_new, subject_span=span)
            patch = AddPatch(value=delta[f : f + 1], slice=(torch.arange(1), torch.tensor([encoded.subject_last])))
            with pg.patch({NODE + ".output": patch}):
                logits = pg(torch.tensor([encoded.ids]), use_cache=False).logits
            row.append(logits[0, encoded.target_start - 1, true_token])
        rows.append(torch.stack(row))
    return torch.stack(rows)


@pytest.mark.parametrize("prefix_cache", [True, False])
def test_term_is_the_mean_hinged_drop_of_the_true_answers_logit(prefix_cache):
    pg, tok, layer, v0 = _setup()
    weight = 0.5
    with_term = BatchValueObjective(pg, tok, layer, REQUESTS, TEMPLATES, v0, true_logit_weight=weight,
                                    prefix_cache=prefix_cache)
    without = BatchValueObjective(pg, tok, layer, REQUESTS, TEMPLATES, v0, prefix_cache=prefix_cache)
    zero = torch.zeros_like(v0)
    first = with_term.loss(zero, [0, 1])  # the references, at δ = 0
    torch.testing.assert_close(first["true_logit_drop"], torch.zeros(2))
    torch.testing.assert_close(first["loss"], without.loss(zero, [0, 1])["loss"])
    delta = (torch.randn(v0.shape, generator=torch.Generator().manual_seed(3)) * 3 * v0.norm(dim=-1, keepdim=True)
             ).requires_grad_(True)
    got = with_term.loss(delta, [1, 0])  # another order than the references were taken in
    plain = without.loss(delta, [1, 0])
    change = _true_logits(pg, tok, delta) - _true_logits(pg, tok, zero).detach()  # [facts, prefixes]
    assert (change > 0).any() and (change < 0).any(), "the hinge should keep some prompts' drops and zero others"
    expected = torch.relu(-change).mean(dim=1)[[1, 0]]
    torch.testing.assert_close(got["true_logit_drop"], expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got["loss"], plain["loss"] + weight * expected, rtol=1e-4, atol=1e-4)
    (grad,) = torch.autograd.grad(got["loss"].sum(), delta)
    (expected_grad,) = torch.autograd.grad((plain["loss"] + weight * expected).sum(), delta)
    assert grad.abs().max() > 0
    torch.testing.assert_close(grad, expected_grad, rtol=1e-3, atol=1e-4)


def test_the_term_needs_the_true_answer_and_a_weight_of_at_least_zero():
    pg, tok, layer, v0 = _setup()
    unknown = [REQUESTS[0], EditRequest("{} was born in ", "the old man", "Rome")]
    with pytest.raises(ValueError, match=r"Request 1 \(subject 'the old man'\) has no target_true"):
        BatchValueObjective(pg, tok, layer, unknown, TEMPLATES, v0, true_logit_weight=0.5)
    BatchValueObjective(pg, tok, layer, unknown, TEMPLATES, v0)  # without the term it is not needed
    with pytest.raises(ValueError, match="true_logit_weight must be 0 or positive"):
        BatchValueObjective(pg, tok, layer, REQUESTS, TEMPLATES, v0, true_logit_weight=-1.0)
    with pytest.raises(ValueError, match="true_logit_weight must be 0"):
        MEMITConfig(true_logit_weight=-0.5)
