"""Training settings that matter for a dictionary's quality at small token budgets, as functions of the step.

- :func:`lr_factor`: the learning rate's multiplier: a linear warm-up from ~0 over the first ``warmup_steps``
  optimizer steps (sparsify's ``lr_warmup_steps``, default 1,000; Rajamanoharan et al. 2024, arXiv 2407.14435,
  appendix I: 1,000 steps), then constant, then a linear decay to 0 over the last ``decay_fraction`` of the run
  (Conerly et al., "Circuits Updates — April 2024", transformer-circuits.pub: the last 20 %).
- :func:`warmup_factor`: the sparsity coefficient λ's multiplier, a linear ramp from ~0 over the first ``steps``
  (Rajamanoharan et al. 2024: 10,000 steps for JumpReLU's L0; Conerly et al.: the first 5 % of the run for L1;
  Ameisen et al. 2025, "Circuit Tracing", methods: ramped up over training for the CLT's tanh penalty).
- :func:`geometric_median`: the point minimising the summed Euclidean distance to the rows (Weiszfeld's iteration),
  the decoder bias's data initialisation of Bricken et al. 2023 ("Towards Monosemanticity", appendix) and SAELens's
  ``b_dec_init_method="geometric_median"``; more robust than the mean to the rare huge rows (attention sinks).
- :func:`least_squares_skip`: a skip transcoder's linear part (W_skip, b_dec) fitted to the first rows by ridge
  regression (Hoerl and Kennard 1970), so that training starts from the best affine map of the MLP input to its output
  and the latents learn only what it leaves; Paulo et al. 2025 (arXiv 2501.18823) start W_skip at 0.
"""

from __future__ import annotations

import torch

__all__ = ["geometric_median", "least_squares_skip", "lr_factor", "warmup_factor"]


def lr_factor(step: int, total_steps: int, warmup_steps: int = 0, decay_fraction: float = 0.0) -> float:
    """The learning rate's multiplier at optimizer step ``step`` (from 0) of ``total_steps``.

    Args:
        step: the optimizer step.
        total_steps: the optimizer steps of the run (≥ 1; the decay ends at 0 there).
        warmup_steps: linear warm-up steps: (step + 1) / warmup_steps until 1 (0: none).
        decay_fraction: the last fraction of ``total_steps`` over which the factor falls linearly to 0 (0: none).

    Returns:
        A factor in [0, 1].
    """
    factor = min(1.0, (step + 1) / warmup_steps) if warmup_steps > 0 else 1.0
    decay_steps = decay_fraction * max(total_steps, 1)
    start = max(total_steps, 1) - decay_steps
    if decay_steps > 0 and step >= start:
        factor *= max(0.0, (total_steps - step) / decay_steps)
    return factor


def warmup_factor(step: int, steps: int) -> float:
    """(step + 1) / steps, at most 1 (1 when ``steps`` is 0): a coefficient's linear warm-up at optimizer step
    ``step``."""
    return min(1.0, (step + 1) / steps) if steps > 0 else 1.0


def geometric_median(points: torch.Tensor, iterations: int = 100, tolerance: float = 1e-5) -> torch.Tensor:
    """The geometric median of the rows of ``points`` ``[n, d]`` (float64 inside), by Weiszfeld's iteration
    (each step: the mean of the rows weighted by 1 / their distance to the estimate), started at the mean; stops
    after ``iterations`` or when a step moves the estimate by less than ``tolerance`` times its norm.

    Returns:
        ``[d]`` in ``points``' dtype.
    """
    x = points.double()
    median = x.mean(0)
    for _ in range(iterations):
        weights = 1.0 / (x - median).norm(dim=-1).clamp_min(1e-12)
        updated = (weights[:, None] * x).sum(0) / weights.sum()
        moved = float((updated - median).norm())
        median = updated
        if moved <= tolerance * max(float(median.norm()), 1e-12):
            break
    return median.to(points.dtype)


def least_squares_skip(x: torch.Tensor, y: torch.Tensor, ridge: float = 1e-4) -> tuple[torch.Tensor, torch.Tensor]:
    """The affine map y ≈ x W_skipᵀ + b that minimises Σ‖x W_skipᵀ + b − y‖² + λ‖W_skip‖² (ridge regression,
    Hoerl and Kennard 1970; float64 inside): a skip transcoder's skip term and decoder bias before training.

    Args:
        x: inputs ``[n, d_in]`` (n ≥ 1; below d_in rows the ridge term keeps the system solvable).
        y: targets ``[n, d_out]``.
        ridge: λ relative to the mean eigenvalue of the centred inputs' second moment (trace(XᵀX) / d_in).

    Returns:
        ``(W_skip [d_out, d_in], b [d_out])`` in ``x``'s dtype; b = mean(y) − mean(x) W_skipᵀ.

    Raises:
        ValueError: ``x`` and ``y`` with different row counts, or no row.
    """
    if x.shape[0] != y.shape[0] or x.shape[0] < 1:
        raise ValueError(f"least_squares_skip needs as many rows of x {tuple(x.shape)} as of y {tuple(y.shape)}, "
                         f"at least one")
    xs, ys = x.double(), y.double()
    x_mean, y_mean = xs.mean(0), ys.mean(0)
    xc, yc = xs - x_mean, ys - y_mean
    gram = xc.T @ xc
    scale = float(gram.diagonal().mean()) if float(gram.diagonal().mean()) > 0 else 1.0
    gram.diagonal().add_(ridge * scale)
    weight = torch.linalg.solve(gram, xc.T @ yc).T  # [d_out, d_in]
    return weight.to(x.dtype), (y_mean - x_mean @ weight.T).to(x.dtype)
