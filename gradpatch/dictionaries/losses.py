"""Local training losses of sparse dictionaries, as pure functions of tensors.

Shapes: targets and reconstructions ``[..., d]`` (every leading dimension counts as tokens), latents and
pre-activations ``[..., m]``, decoder ``W_dec`` ``[m, d]``.

- :func:`normalized_mse`: Σ‖x̂ − x‖² / Σ‖x − mean(x)‖², the fraction of variance unexplained (FVU) that Gao et al.
  2024 (arXiv 2406.04093, section 2.1) and sparsify train on; 1 for the mean predictor.
- :func:`auxk_loss`: Gao et al.'s auxiliary loss for dead latents (appendix A.2): the residual e = x − x̂ is
  reconstructed from the ``k_aux`` largest pre-activations of the dead latents only, ê = TopK_aux(h_dead) W_dec;
  the loss is Σ‖ê − e‖² divided by the residual's variance Σ‖e − mean(e)‖² (normalized_mse(ê, e), the default) or,
  given the target y, by the target's Σ‖y − mean(y)‖² as sparsify divides it; scaled by min(n_dead / k_aux, 1) as
  sparsify does.
- :func:`l1_penalty`: Σ_i |z_i| ‖W_dec[i]‖ per token, averaged (ReLU SAEs; the decoder norm keeps the penalty from
  being dodged by shrinking z and growing W_dec, Anthropic's April 2024 update).
- :func:`jumprelu_l0`: Σ_i H(h_i − θ_i) per token, averaged, with the straight-through θ gradient of Rajamanoharan
  et al. 2024 (arXiv 2407.14435, eq. 12).
- :func:`unit_norm_rows` and :func:`remove_parallel_gradient`: the unit-norm decoder constraint (Gao et al. section
  2.2: after each step rows are renormalised, and the gradient component parallel to each row is removed first).

Cross-layer transcoders (Ameisen et al. 2025, "Circuit Tracing", transformer-circuits.pub/2025/attribution-graphs/
methods.html, section "Building an interpretable replacement model"):

- :func:`tanh_penalty`: λ's term Σ_i tanh(c · ‖W_dec,i‖ · a_i) per token, averaged, with ‖W_dec,i‖ the norm of the
  concatenation of latent i's decoder vectors into every output layer it writes (the CLT's sparsity penalty; the
  tanh penalty of Anthropic's "Circuits Updates — February 2024").
- :func:`pre_activation_loss`: Σ_i ReLU(θ_i − h_i) ‖W_dec,i‖ per token, averaged: a small push up on latents below
  their threshold, against dead latents (Anthropic's "Circuits Updates — January 2025", the crosscoder's pre-activation
  loss; θ = 0 for ReLU).
- :func:`cross_layer_auxk_loss`: Gao et al.'s AuxK carried to a CLT: each output layer's residual reconstructed from
  the ``k_aux`` largest pre-activations of the dead latents of every layer that writes to it.
"""

from __future__ import annotations

import torch

from .activations import step

__all__ = ["auxk_loss", "cross_layer_auxk_loss", "jumprelu_l0", "l1_penalty", "normalized_mse", "pre_activation_loss",
           "remove_parallel_gradient", "sparse_decode", "tanh_penalty", "unit_norm_rows"]


def _tokens(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


def normalized_mse(reconstruction: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Σ‖x̂ − x‖² / Σ‖x − mean(x)‖² over all tokens (scalar; the mean is over tokens, per dimension).

    Args:
        reconstruction: x̂ ``[..., d]``.
        target: x ``[..., d]``, same shape.
    """
    x = _tokens(target)
    error = (_tokens(reconstruction) - x).pow(2).sum()
    return error / (x - x.mean(0)).pow(2).sum().clamp_min(torch.finfo(x.dtype).tiny)


def auxk_loss(pre_activations: torch.Tensor, residual: torch.Tensor, W_dec: torch.Tensor,  # noqa: N803
              dead: torch.Tensor, k_aux: int, target: torch.Tensor | None = None) -> torch.Tensor:
    """Gao et al.'s AuxK loss (appendix A.2), scaled by min(n_dead / k_aux, 1) (0 when no latent is dead).

    The two normalisations differ by the main loss's FVU: Σ‖e − mean(e)‖² ≈ FVU · Σ‖y − mean(y)‖², so at the same
    coefficient α the residual's divisor weighs AuxK 1 / FVU times more than sparsify's (10× at an FVU of 0.1), and
    its weight grows as the reconstruction improves. (sparsify's ê also adds b_dec; ours has no bias term.)

    Args:
        pre_activations: h ``[..., m]``.
        residual: e = x − x̂ ``[..., d]`` (detached here: the main reconstruction gets no gradient from this term).
        W_dec: ``[m, d]``.
        dead: ``[m]`` booleans, the latents that fired on none of the last many tokens.
        k_aux: dead latents used per token (Gao et al.: 512 for d = 768; sparsify: d / 2).
        target: y ``[..., d]``, the main loss's target, as many tokens as ``residual``: divide by its variance
            Σ‖y − mean(y)‖² (sparsify's ``total_variance``) instead of the residual's (``None``, the default:
            normalized_mse(ê, e)).

    Returns:
        A scalar.

    Raises:
        ValueError: ``target`` of another shape than ``residual`` (flattened to tokens).
    """
    if target is not None and _tokens(target).shape != _tokens(residual).shape:
        raise ValueError(f"auxk_loss: target {tuple(target.shape)} must have the residual's tokens and width "
                         f"{tuple(_tokens(residual).shape)}; pass the main loss's target")
    count = int(dead.sum())
    if count == 0:
        return pre_activations.new_zeros(())
    k = min(k_aux, count)
    masked = torch.where(dead, _tokens(pre_activations), torch.full_like(_tokens(pre_activations), -torch.inf))
    values, indices = masked.topk(k, dim=-1, sorted=False)
    latents = torch.zeros_like(masked).scatter(-1, indices, values.relu())
    estimate = latents @ W_dec
    scale = min(count / k_aux, 1.0)
    if target is None:
        return scale * normalized_mse(estimate, _tokens(residual).detach())
    y = _tokens(target).detach()
    variance = (y - y.mean(0)).pow(2).sum().clamp_min(torch.finfo(y.dtype).tiny)
    return scale * (estimate - _tokens(residual).detach()).pow(2).sum() / variance


def l1_penalty(latents: torch.Tensor, W_dec: torch.Tensor) -> torch.Tensor:  # noqa: N803
    """mean over tokens of Σ_i |z_i| ‖W_dec[i]‖₂ (scalar). ``latents`` ``[..., m]``, ``W_dec`` ``[m, d]``."""
    return (_tokens(latents).abs() * W_dec.norm(dim=-1)).sum(-1).mean()


def jumprelu_l0(pre_activations: torch.Tensor, threshold: torch.Tensor, bandwidth: float) -> torch.Tensor:
    """mean over tokens of Σ_i H(h_i − θ_i) (scalar), differentiable in θ by the paper's pseudo-derivative.

    Args:
        pre_activations: h ``[..., m]``.
        threshold: θ ``[m]``.
        bandwidth: ε.
    """
    return step(_tokens(pre_activations), threshold, bandwidth).sum(-1).mean()


def unit_norm_rows(W_dec: torch.Tensor) -> torch.Tensor:  # noqa: N803
    """W_dec with each row divided by its L2 norm (``[m, d]``; a zero row stays zero)."""
    return W_dec / W_dec.norm(dim=-1, keepdim=True).clamp_min(torch.finfo(W_dec.dtype).eps)


def remove_parallel_gradient(W_dec: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:  # noqa: N803
    """The gradient of unit-norm rows ``W_dec`` ``[m, d]`` without its component along each row:
    g_i − (g_i · w_i) w_i."""
    return grad - (grad * W_dec).sum(-1, keepdim=True) * W_dec


def tanh_penalty(latents: torch.Tensor, decoder_norms: torch.Tensor, c: float) -> torch.Tensor:
    """mean over tokens of Σ_i tanh(c · ‖W_dec,i‖ · a_i) (scalar; Ameisen et al. 2025, the CLT's sparsity penalty).

    Args:
        latents: a ``[..., m]`` (≥ 0).
        decoder_norms: ‖W_dec,i‖ ``[m]``, for a CLT the norm of latent i's decoders into every output layer
            concatenated.
        c: the scale inside the tanh (how soon the penalty saturates).
    """
    return torch.tanh(c * _tokens(latents) * decoder_norms).sum(-1).mean()


def pre_activation_loss(pre_activations: torch.Tensor, threshold: torch.Tensor | float,
                        decoder_norms: torch.Tensor) -> torch.Tensor:
    """mean over tokens of Σ_i ReLU(θ_i − h_i) ‖W_dec,i‖ (scalar; Anthropic's January 2025 update): pushes the
    pre-activations ``h`` ``[..., m]`` of latents below their threshold θ (``[m]``, or 0 for ReLU) up, in proportion
    to their decoder norms ``[m]``."""
    return ((threshold - _tokens(pre_activations)).relu() * decoder_norms).sum(-1).mean()


def sparse_decode(indices: torch.Tensor, values: torch.Tensor, W_dec: torch.Tensor) -> torch.Tensor:  # noqa: N803
    """Σ_j values[..., j] W_dec[indices[..., j]]: latents given as their ``k`` active ``indices`` and ``values``
    ``[n, k]`` decoded by ``W_dec`` ``[m, d]`` into ``[n, d]`` without the dense ``[n, m]`` latents (n·k·d
    multiply-adds instead of n·m·d; ``torch.nn.functional.embedding_bag``, differentiable in ``values`` and
    ``W_dec``): what a TopK latent vector decodes to."""
    return torch.nn.functional.embedding_bag(indices, W_dec, per_sample_weights=values.to(W_dec.dtype), mode="sum")


def cross_layer_auxk_loss(pre_activations: list[torch.Tensor], residuals: list[torch.Tensor],
                          W_dec: list[torch.Tensor], dead: torch.Tensor, k_aux: int) -> torch.Tensor:  # noqa: N803
    """AuxK (Gao et al. 2024, appendix A.2) for a cross-layer transcoder: the mean over output layers l′ of
    normalized_mse(ê_l′, e_l′), ê_l′ = Σ_{l ≤ l′} TopK_aux(h_l over its dead latents) W_dec[l][:, l′ − l], each
    layer's term scaled by min(n_dead / k_aux, 1) as :func:`auxk_loss` scales (n_dead: the dead latents of the
    layers that write to l′); 0 when no latent is dead.

    Args:
        pre_activations: h_l ``[n, m]`` per layer.
        residuals: e_l′ = y_l′ − ŷ_l′ ``[n, d]`` per output layer (detached here).
        W_dec: ``[m, L − l, d]`` per layer.
        dead: ``[L, m]`` booleans.
        k_aux: dead latents used per token and layer.

    Returns:
        A scalar.
    """
    count = dead.shape[0]
    if not bool(dead.any()):
        return pre_activations[0].new_zeros(())
    estimates: list[torch.Tensor | None] = [None] * count
    for layer in range(count):
        n_dead = int(dead[layer].sum())
        if n_dead == 0:
            continue
        h = _tokens(pre_activations[layer])
        masked = torch.where(dead[layer], h, torch.full_like(h, -torch.inf))
        values, indices = masked.topk(min(k_aux, n_dead), dim=-1, sorted=False)
        decoded = sparse_decode(indices, values.relu(), W_dec[layer].flatten(1)).unflatten(-1, W_dec[layer].shape[1:])
        for offset in range(count - layer):
            target = layer + offset
            part = decoded[:, offset]
            estimates[target] = part if estimates[target] is None else estimates[target] + part
    terms = []
    for target, estimate in enumerate(estimates):
        if estimate is None:
            continue
        n_dead = int(dead[:target + 1].sum())
        terms.append(min(n_dead / k_aux, 1.0) * normalized_mse(estimate, _tokens(residuals[target]).detach()))
    return torch.stack(terms).mean()
