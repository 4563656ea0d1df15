"""Closed-form many-fact updates of one linear layer: MEMIT (arXiv 2210.07229, eq. 14) and AlphaEdit
(arXiv 2410.02355, §3, the null-space projected update).

Both store ``F`` new associations ``K -> W K + R`` (keys ``K`` ``[d_in, F]``, residuals ``R`` ``[d_out, F]``: what each
key's output must gain) in a layer ``W`` ``[d_out, d_in]`` whose preserved keys have the uncentred second moment
``C = E[k kᵀ]`` ``[d_in, d_in]``, and return the change as factors ``ΔW = V Uᵀ`` with ``V = R``:

- MEMIT:  ``ΔW = R Kᵀ (λ C + K_n K_nᵀ + K Kᵀ)⁻¹``, so ``U = (λ C + K_n K_nᵀ + K Kᵀ)⁻¹ K``. ``λ``
  (``mom2_update_weight``, 15,000 in the reference code) weighs the preserved keys against the new ones;
  ``K_n K_nᵀ`` (zero in the paper) adds keys chosen to be preserved (``MEMIT.preserve``): more columns of the
  paper's preserved-key matrix ``K_0``, whose outputs the update keeps as it keeps those of ``C``.
- AlphaEdit: ``ΔW = R Kᵀ P (K_p K_pᵀ P + K Kᵀ P + α I)⁻¹``, so ``U = P (P (K Kᵀ + K_p K_pᵀ) + α I)⁻¹ P K``, where
  ``P`` projects onto the null space of ``C`` (:func:`null_space_projector`): ``ΔW k = 0`` for every key in the
  span of the preserved keys, so the update cannot disturb them; ``K_p K_pᵀ`` sums the keys of the facts edited by
  earlier batches (kept by the editor) and any keys chosen to be preserved (``MEMIT.preserve``), and ``α``
  (``L2``, 10 in the reference code) regularises ``ΔW``.

**Keys per context.** Keys may also be given per context prompt, ``[F, P, d_in]``: every context's key is a column
of ``K`` with its fact's residual (the reference code's ``repeat_interleave`` of the targets), so
``ΔW = R_F E Kᵀ (...)⁻¹`` with ``E`` summing each fact's ``P`` columns: still rank ``F``, ``U`` the per-fact sums of
the solved columns.

All algebra runs in float64.
"""

from __future__ import annotations

import torch

from ..errors import StatisticsError

__all__ = ["added", "alphaedit_factors", "mahalanobis_norms", "memit_factors", "null_space_projector",
           "relative_update_weight"]


def _as_columns(keys: torch.Tensor, residuals: torch.Tensor, d_in: int, node: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``K`` ``[d_in, F·P]`` (fact-major) and ``R`` ``[d_out, F]`` in float64 from row-major ``[F, d_in]`` or
    ``[F, P, d_in]`` keys and ``[F, d_out]`` residuals."""
    if (keys.dim() not in (2, 3) or residuals.dim() != 2 or keys.shape[0] != residuals.shape[0]
            or keys.shape[-1] != d_in):
        raise ValueError(f"{node}: keys {list(keys.shape)} and residuals {list(residuals.shape)} must be [F, {d_in}] "
                         f"(or [F, P, {d_in}]) and [F, d_out] for the same F")
    return keys.detach().to(torch.float64).reshape(-1, d_in).T, residuals.detach().to(torch.float64).T


def _per_fact(solved: torch.Tensor, n_facts: int) -> torch.Tensor:
    """``[d_in, F·P]`` solved columns -> ``[d_in, F]``: each fact's columns summed (``E`` of the module docstring)."""
    return solved.reshape(solved.shape[0], n_facts, -1).sum(dim=-1)


def mahalanobis_norms(keys: torch.Tensor, second_moment: torch.Tensor, node: str = "the layer") -> torch.Tensor:
    """``m_i = k_iᵀ C⁻¹ k_i`` for each key: how far the key lies outside what ``C`` already holds (dimensionless).

    For a key drawn from the distribution ``C`` describes, ``E[m] = tr(C⁻¹ C) = d_in``. ``λC`` and ``kkᵀ`` share the
    key's units, so ``m`` is the scale-free size of ``kkᵀ`` against ``C``: one fact alone, ``ΔW = r kᵀ(λC + kkᵀ)⁻¹``
    writes ``ΔW k = r · m / (λ + m)`` (Sherman–Morrison), the fraction ``m / (λ + m)`` of its residual.

    Args:
        keys: ``[F, d_in]`` or ``[F, P, d_in]`` (every column counted).
        second_moment: ``C`` ``[d_in, d_in]``, positive definite.
        node: the layer's NodePath, for messages.

    Returns:
        ``[F]`` or ``[F, P]`` float64.

    Raises:
        StatisticsError: ``C`` is not positive definite (names ``node`` and the fix).
    """
    c = second_moment.to(dtype=torch.float64, device=keys.device)
    factor, info = torch.linalg.cholesky_ex(c)
    if int(info) != 0:
        raise StatisticsError(f"{node}: the second moment C is not positive definite (leading minor {int(info)}); "
                              f"compute the statistics over more text (n_samples) or give an absolute "
                              f"mom2_update_weight")
    k = keys.detach().to(torch.float64).reshape(-1, c.shape[0])  # [N, d_in]
    return (k * torch.cholesky_solve(k.T, factor).T).sum(dim=-1).reshape(keys.shape[:-1])


def relative_update_weight(keys: torch.Tensor, second_moment: torch.Tensor, relative_weight: float,
                           node: str = "the layer") -> float:
    """``λ = relative_weight · mean_i k_iᵀ C⁻¹ k_i`` over the edited keys: MEMIT's covariance weight (eq. 14) relative
    to the statistics, so one ``relative_weight`` writes the same fraction of a typical fact's residual at any width
    and key scale (:func:`mahalanobis_norms`: ``1 / (1 + relative_weight)`` for one fact).

    The reference code's absolute ``λ = 15,000`` for GPT-J (``d_in = 16,384``) is about ``1 × d_in``; on SmolLM2-135M
    (``d_in = 1,536``) the same number is many times the edited keys' ``m`` (docs/memit.md, "A covariance weight
    relative to the statistics").

    Args:
        keys: ``[F, d_in]`` or ``[F, P, d_in]``.
        second_moment: ``C`` ``[d_in, d_in]``.
        relative_weight: the multiple (> 0).
        node: the layer's NodePath, for messages.

    Raises:
        ValueError: ``relative_weight`` not positive.
        StatisticsError: ``C`` not positive definite.
    """
    if not relative_weight > 0:
        raise ValueError(f"relative_weight must be positive, got {relative_weight!r}")
    return relative_weight * float(mahalanobis_norms(keys, second_moment, node).mean())


def memit_factors(keys: torch.Tensor, residuals: torch.Tensor, second_moment: torch.Tensor, mom2_update_weight: float,
                  node: str = "the layer", preserved: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """MEMIT's update of one layer (eq. 14): ``ΔW = R Kᵀ (λ C + K_n K_nᵀ + K Kᵀ)⁻¹ = V Uᵀ``.

    Args:
        keys: ``[F, d_in]``: each fact's key at this layer (``K`` transposed), or ``[F, P, d_in]``: per context.
        residuals: ``[F, d_out]``: what each fact's output at this layer must gain (``R`` transposed).
        second_moment: ``C`` ``[d_in, d_in]``.
        mom2_update_weight: ``λ`` (> 0 unless the keys alone span ``d_in``).
        node: the layer's NodePath, for messages.
        preserved: ``K_n K_nᵀ`` ``[d_in, d_in]``: summed outer products of keys to preserve, or ``None`` (none).

    Returns:
        ``U = (λ C + K_n K_nᵀ + K Kᵀ)⁻¹ K`` ``[d_in, F]`` and ``V = R`` ``[d_out, F]``, float64.

    Raises:
        StatisticsError: ``λ C + K Kᵀ`` is singular or not finite, or ``C`` has the wrong shape (names ``node`` and
            the fix).
    """
    d_in = second_moment.shape[-1]
    k, r = _as_columns(keys, residuals, d_in, node)
    if second_moment.shape != (d_in, d_in):
        raise StatisticsError(f"{node}: second moment of shape {list(second_moment.shape)} is not square")
    system = mom2_update_weight * second_moment.to(device=k.device, dtype=torch.float64) + k @ k.T  # [d_in, d_in]
    if preserved is not None:
        system = system + preserved.to(device=k.device, dtype=torch.float64)
    try:
        factor, info = torch.linalg.cholesky_ex(system)
        if int(info) != 0:
            raise RuntimeError(f"leading minor {int(info)} is not positive")
        u = _per_fact(torch.cholesky_solve(k, factor), r.shape[1])  # [d_in, F]
    except RuntimeError as exc:
        raise StatisticsError(
            f"{node}: λC + KKᵀ (λ = {mom2_update_weight:g}) is singular ({exc}); raise mom2_update_weight or compute "
            f"the statistics over more text (n_samples); the weights were not changed") from None
    if not bool(torch.isfinite(u).all()):
        raise StatisticsError(f"{node}: (λC + KKᵀ)⁻¹K is not finite; recompute the statistics over more text")
    return u, r


def null_space_projector(second_moment: torch.Tensor, threshold: float, node: str = "the layer"
                         ) -> tuple[torch.Tensor, int]:
    """AlphaEdit's projector onto the (numerical) null space of the preserved keys' second moment.

    ``C = Q diag(e) Qᵀ`` (eigendecomposition; ``C`` symmetric); the eigenvectors whose eigenvalue is below
    ``threshold`` span the directions the preserved keys (almost) never take: ``P = Q_s Q_sᵀ`` (the reference code
    takes the SVD of ``C`` and the singular values below ``nullspace_threshold = 2e-2``; for a symmetric positive
    semi-definite ``C`` those are its eigenvalues).

    Args:
        second_moment: ``C`` ``[d_in, d_in]``.
        threshold: eigenvalues below it count as zero.
        node: the layer's NodePath, for messages.

    Returns:
        ``(P [d_in, d_in] float64, dimension of the null space)``.

    Raises:
        StatisticsError: no eigenvalue is below ``threshold`` (every update would be projected to zero: raise the
            threshold), or ``C`` is not finite.
    """
    c = second_moment.to(torch.float64)
    if not bool(torch.isfinite(c).all()):
        raise StatisticsError(f"{node}: the second moment holds NaN or inf; recompute the statistics")
    eigenvalues, vectors = torch.linalg.eigh((c + c.T) / 2)
    small = eigenvalues < threshold
    n_null = int(small.sum())
    if n_null == 0:
        raise StatisticsError(
            f"{node}: no eigenvalue of C is below the null-space threshold {threshold:g} (smallest "
            f"{float(eigenvalues[0]):.3g}), so every update would be projected to zero; raise nullspace_threshold")
    basis = vectors[:, small]  # [d_in, n_null]
    return basis @ basis.T, n_null


def alphaedit_factors(keys: torch.Tensor, residuals: torch.Tensor, projector: torch.Tensor, previous: torch.Tensor,
                      l2: float, node: str = "the layer") -> tuple[torch.Tensor, torch.Tensor]:
    """AlphaEdit's update of one layer: ``ΔW = R Kᵀ P (K_p K_pᵀ P + K Kᵀ P + α I)⁻¹ = V Uᵀ``.

    Args:
        keys: ``[F, d_in]``: this batch's keys at this layer (or ``[F, P, d_in]``: per context).
        residuals: ``[F, d_out]``: what each fact's output must gain.
        projector: ``P`` ``[d_in, d_in]`` (:func:`null_space_projector`).
        previous: ``K_p K_pᵀ`` ``[d_in, d_in]``: the summed outer products of earlier batches' keys (zeros at first).
        l2: ``α`` (> 0).
        node: the layer's NodePath, for messages.

    Returns:
        ``U = P (P (K Kᵀ + K_p K_pᵀ) + α I)⁻¹ P K`` ``[d_in, F]`` and ``V = R`` ``[d_out, F]``, float64; ``ΔW`` maps
        every vector outside the range of ``P`` to zero.

    Raises:
        StatisticsError: the system is singular or not finite (names ``node``).
    """
    d_in = projector.shape[-1]
    k, r = _as_columns(keys, residuals, d_in, node)
    p = projector.to(device=k.device, dtype=torch.float64)
    system = p @ (k @ k.T + previous.to(device=k.device, dtype=torch.float64)) + l2 * torch.eye(
        d_in, dtype=torch.float64, device=k.device)
    try:
        u = p @ _per_fact(torch.linalg.solve(system, p @ k), r.shape[1])  # [d_in, F]
    except RuntimeError as exc:
        raise StatisticsError(f"{node}: P(KKᵀ + K_pK_pᵀ) + αI (α = {l2:g}) is singular ({exc}); raise L2; the "
                              f"weights were not changed") from None
    if not bool(torch.isfinite(u).all()):
        raise StatisticsError(f"{node}: the AlphaEdit solve is not finite; raise L2")
    return u, r


def added(totals: list[torch.Tensor], moments: list[torch.Tensor]) -> list[torch.Tensor]:
    """Per-layer sums of keys' outer products (``Σ k kᵀ``, ``[d_in, d_in]`` each) with ``moments`` added layer by
    layer; ``totals`` empty (nothing kept yet) gives ``moments``."""
    return moments if not totals else [a + b for a, b in zip(totals, moments, strict=True)]
