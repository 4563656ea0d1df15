"""The sparsifying activations of a dictionary: pre-activations ``h`` (``[..., m]``) -> latents ``z`` (``[..., m]``).

- ReLU: z = max(h, 0); sparsity comes from an L1 penalty in the loss (:func:`gradpatch.dictionaries.losses.l1_penalty`).
- TopK (Gao et al. 2024, "Scaling and evaluating sparse autoencoders", arXiv 2406.04093, section 2.3):
  z = ReLU(TopK_k(h)), the k largest entries of each token's ``h`` kept, the others zeroed.
- BatchTopK (Bussmann et al. 2024, "BatchTopK Sparse Autoencoders", arXiv 2412.06410): in training, the k·N largest
  entries of the ``N`` tokens' ReLU(h) together are kept (k per token on average); in evaluation, a global threshold
  θ learned in training (the running mean of the smallest kept value) applies per token: z = h · H(h − θ), so a
  token's latents do not depend on the rest of its batch.
- JumpReLU (Rajamanoharan et al. 2024, "Jumping Ahead: Improving Reconstruction Fidelity with JumpReLU Sparse
  Autoencoders", arXiv 2407.14435, eq. 4 and section 4): z = h · H(h − θ) with a learned threshold θ ∈ ℝ^m. H has
  no useful derivative, so the paper uses a straight-through estimator with the rectangle kernel
  K(u) = 1[−½ < u < ½] of bandwidth ε: ∂z/∂θ := −(θ/ε) K((h − θ)/ε) (eq. 11), ∂z/∂h := H(h − θ) (no estimator on h).
  :func:`step` is H with the pseudo-derivative ∂H(h − θ)/∂θ := −(1/ε) K((h − θ)/ε) (eq. 12), used by the L0 penalty.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["ACTIVATIONS", "batch_topk", "jumprelu", "rectangle", "step", "topk"]

#: The activation names a dictionary config accepts.
ACTIVATIONS = ("relu", "topk", "batchtopk", "jumprelu")


def rectangle(u: torch.Tensor) -> torch.Tensor:
    """K(u) = 1 where −½ < u < ½, else 0 (same shape and dtype as ``u``)."""
    return ((u > -0.5) & (u < 0.5)).to(u.dtype)


class _JumpReLU(torch.autograd.Function):
    """z = h · H(h − θ); backward: ∂z/∂h = H(h − θ), ∂z/∂θ = −(θ/ε) K((h − θ)/ε) (Rajamanoharan et al., eq. 11)."""

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, threshold: torch.Tensor, bandwidth: float) -> torch.Tensor:
        ctx.save_for_backward(h, threshold)
        ctx.bandwidth = bandwidth
        return torch.where(h > threshold, h, torch.zeros_like(h))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        h, threshold = ctx.saved_tensors
        eps = ctx.bandwidth
        grad_h = (h > threshold).to(grad.dtype) * grad
        grad_threshold = -(threshold / eps) * rectangle((h - threshold) / eps) * grad
        return grad_h, _sum_to(grad_threshold, threshold.shape), None


class _Step(torch.autograd.Function):
    """H(h − θ); backward: ∂/∂θ = −(1/ε) K((h − θ)/ε) (Rajamanoharan et al., eq. 12), nothing to ``h``."""

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, threshold: torch.Tensor, bandwidth: float) -> torch.Tensor:
        ctx.save_for_backward(h, threshold)
        ctx.bandwidth = bandwidth
        return (h > threshold).to(h.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor, None]:
        h, threshold = ctx.saved_tensors
        eps = ctx.bandwidth
        grad_threshold = -(1.0 / eps) * rectangle((h - threshold) / eps) * grad
        return None, _sum_to(grad_threshold, threshold.shape), None


def _sum_to(grad: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """``grad`` summed over the broadcast (leading) dimensions down to ``shape``."""
    return grad.sum_to_size(shape) if grad.shape != shape else grad


def jumprelu(h: torch.Tensor, threshold: torch.Tensor, bandwidth: float) -> torch.Tensor:
    """JumpReLU_θ(h) = h · H(h − θ) with the paper's straight-through gradient for θ.

    Args:
        h: pre-activations ``[..., m]``.
        threshold: θ, ``[m]`` (or a scalar).
        bandwidth: ε > 0 of the rectangle kernel (0.001 in the paper, for inputs normalised to unit mean
            squared norm).

    Returns:
        z ``[..., m]``.
    """
    return _JumpReLU.apply(h, threshold.to(h.dtype), bandwidth)


def step(h: torch.Tensor, threshold: torch.Tensor, bandwidth: float) -> torch.Tensor:
    """H(h − θ) (0 or 1, ``[..., m]``) with the pseudo-derivative −(1/ε) K((h − θ)/ε) for θ (the L0 penalty's)."""
    return _Step.apply(h, threshold.to(h.dtype), bandwidth)


def topk(h: torch.Tensor, k: int) -> torch.Tensor:
    """ReLU(TopK_k(h)) along the last dimension: each token keeps its ``k`` largest pre-activations (clamped at 0).

    Gradients reach the kept entries only. Args: ``h`` ``[..., m]``, 1 ≤ ``k`` ≤ m. Returns z ``[..., m]``.
    """
    values, indices = torch.topk(h, k, dim=-1, sorted=False)
    return torch.zeros_like(h).scatter(-1, indices, values.relu())


def batch_topk(h: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """BatchTopK: the ``k · N`` largest entries of ReLU(h) over all ``N`` tokens of the batch together.

    Args:
        h: ``[..., m]``; every leading dimension counts as tokens.
        k: the mean number of active latents per token.

    Returns:
        z ``[..., m]``, and the smallest positive kept value (a scalar, 0 when none is positive: what the
        evaluation threshold θ tracks).
    """
    flat = h.relu().reshape(-1)
    count = min(k * max(h.numel() // h.shape[-1], 1), flat.numel())
    values, indices = torch.topk(flat, count, sorted=False)
    z = torch.zeros_like(flat).scatter(0, indices, values).reshape(h.shape)
    positive = values.detach()[values.detach() > 0]
    return z, positive.min() if positive.numel() else positive.new_zeros(())
