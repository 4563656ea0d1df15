"""token_log_probs: the chosen tokens' log-softmax values and their gradient, block by block, in any logits dtype."""

from __future__ import annotations

import pytest
import torch

import editors.passes.token_log_probs as module
from editors.passes.token_log_probs import token_log_probs


def _reference(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.float(), dim=-1)[torch.arange(len(tokens)), tokens]


@pytest.mark.parametrize("block", [7, 1 << 19])  # several rows per block, and blocks of one row (vocab > block)
def test_values_and_gradient_match_the_log_softmax(monkeypatch, block):
    monkeypatch.setattr(module, "BLOCK_ELEMENTS", block)
    torch.manual_seed(0)
    logits = (torch.randn(13, 50) * 4).requires_grad_()
    before = logits.detach().clone()
    tokens = torch.randint(0, 50, (13,))
    weights = torch.randn(13)
    ours = token_log_probs(logits, tokens)
    assert ours.dtype == torch.float32
    (ours * weights).sum().backward()
    grad = logits.grad.clone()
    logits.grad = None
    (_reference(logits, tokens) * weights).sum().backward()
    torch.testing.assert_close(ours, _reference(logits, tokens).detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad, logits.grad, rtol=1e-5, atol=1e-6)
    assert torch.equal(logits.detach(), before)  # float32 logits are not used as the backward's workspace


def test_bfloat16_logits_keep_their_dtype_and_do_not_change():
    torch.manual_seed(1)
    logits = (torch.randn(6, 300) * 5).bfloat16().requires_grad_()
    before = logits.detach().clone()
    tokens = torch.tensor([0, 299, 5, 5, 17, 120])
    ours = token_log_probs(logits, tokens)
    ours.sum().backward()
    assert torch.equal(logits.detach(), before)  # the backward pass works on its own float32 copy
    assert logits.grad.dtype == torch.bfloat16
    torch.testing.assert_close(ours, _reference(before, tokens), rtol=0, atol=1e-5)
    expected = torch.nn.functional.one_hot(tokens, 300).float() - torch.softmax(before.float(), dim=-1)
    torch.testing.assert_close(logits.grad.float(), expected, rtol=0.01, atol=1e-3)


def test_empty_rows_and_bad_shapes():
    empty = torch.zeros(0, 9, requires_grad=True)
    out = token_log_probs(empty, torch.zeros(0, dtype=torch.long))
    out.sum().backward()
    assert out.shape == (0,) and empty.grad.shape == (0, 9)
    with pytest.raises(ValueError, match=r"\[n, vocab\]"):
        token_log_probs(torch.zeros(2, 3, 4), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="integer ids"):
        token_log_probs(torch.zeros(2, 3), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="integer ids"):
        token_log_probs(torch.zeros(2, 3), torch.zeros(2))
