"""Log-probabilities of chosen tokens from logits, without a float32 copy of the whole log-softmax.

ROME's value objective (Meng et al. 2022, §3.1, eq. 4) and the CounterFact scores read one token's log-probability
per logit row, ``log p(t) = z_t − logsumexp(z)``. Written as ``log_softmax(logits.float())[rows, tokens]`` this
allocates four full ``[n, vocab]`` float32 tensors per pass (the float copy, the log-softmax, and in the backward pass
the zero-filled gradient of the indexing and the log-softmax's gradient) and reindexes them; with SmolLM2's 49,152-word
vocabulary and the ~900 target rows of a 100-fact value-search step these were 19 % of the step on 2 CPU cores
(docs/memit.md). :func:`token_log_probs` works through the rows in blocks of :data:`BLOCK_ELEMENTS` numbers, so each
temporary is a few megabytes and reused, and its backward pass writes ``∂/∂z = g · (onehot(t) − softmax(z))``
straight into one gradient tensor of the logits' dtype. Results equal the log-softmax's up to float rounding
(accumulation in float32, ``tests/editors/test_token_log_probs.py``).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["BLOCK_ELEMENTS", "token_log_probs"]

#: Logit numbers per block of rows (float32 temporaries of 2 MB; 2**15 to 2**23 measured within 15 % of each other).
BLOCK_ELEMENTS = 1 << 19


def _block_rows(vocab: int) -> int:
    """Rows per block of :data:`BLOCK_ELEMENTS` numbers (at least one)."""
    return max(1, BLOCK_ELEMENTS // max(1, vocab))


class _TokenLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        rows, vocab = logits.shape
        step = _block_rows(vocab)
        lse = torch.empty(rows, dtype=torch.float32, device=logits.device)
        for start in range(0, rows, step):
            lse[start : start + step] = torch.logsumexp(logits[start : start + step].float(), dim=-1)
        picked = logits.gather(1, tokens[:, None]).squeeze(1).float()
        ctx.save_for_backward(logits, tokens, lse)
        return picked - lse

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        logits, tokens, lse = ctx.saved_tensors
        rows, vocab = logits.shape
        step = _block_rows(vocab)
        out = torch.empty_like(logits)
        grad = grad.float()
        for start in range(0, rows, step):
            end = min(rows, start + step)
            block = logits[start:end].to(torch.float32, copy=True)  # softmax · (−g), in place
            block.sub_(lse[start:end, None]).exp_().mul_(-grad[start:end, None])
            block.scatter_add_(1, tokens[start:end, None], grad[start:end, None])
            out[start:end] = block
        return out, None


def token_log_probs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``log softmax(logits)[i, tokens[i]]`` for every row, accumulated in float32; differentiable with respect to
    ``logits`` (the gradient in their dtype).

    Args:
        logits: ``[n, vocab]`` (any floating dtype; bfloat16 logits are read in float32 block by block).
        tokens: ``[n]`` token ids (integers in ``[0, vocab)``).

    Returns:
        ``[n]`` float32 log-probabilities (nats).

    Raises:
        ValueError: ``logits`` is not 2-D, or ``tokens`` is not ``[n]`` integers.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [n, vocab], got {list(logits.shape)}")
    if tokens.shape != logits.shape[:1] or tokens.dtype.is_floating_point:
        raise ValueError(f"tokens must be [{logits.shape[0]}] integer ids, got {list(tokens.shape)} {tokens.dtype}")
    return _TokenLogProbs.apply(logits, tokens.long())
