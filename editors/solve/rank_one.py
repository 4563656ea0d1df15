"""The closed-form rank-one update of ROME (Meng et al. 2022, eq. 2).

Given a linear layer ``W`` (``[d_out, d_in]``), the uncentred second moment of its keys ``C = E[k kᵀ]``
(``[d_in, d_in]``), a key ``k*`` and a desired value ``v*``, the minimum-change update (in the ``C``-weighted
norm) that stores ``k* -> v*`` is::

    W' = W + (v* - W k*) (C⁻¹ k*)ᵀ / ((C⁻¹ k*)ᵀ k*)                               (eq. 2)

We keep it as two factors, ``W' = W + v uᵀ`` with

    u = C⁻¹ k* / (k*ᵀ C⁻¹ k*)     [d_in]     (so uᵀ k* = 1)
    v = v* - W k*                  [d_out]

so that ``W' k* = v*`` exactly and any key ``k`` with ``kᵀ C⁻¹ k* = 0`` (``uᵀ k = 0``) is mapped as before.
The same ``k*`` must be used for ``v`` and ``u``: here both come from the context-averaged key.
"""

from __future__ import annotations

import torch

from ..errors import StatisticsError

__all__ = ["rank_one_factors", "rank_one_update", "solve_second_moment", "update_direction"]

# Keys per context: Gram eigenvalues below _GRAM_RTOL of the largest are dropped, so keys equal up to float32 rounding
# count as one key (on SmolLM2's 44 cases, layers 0-3, a repeated key gives <= 2e-13 and distinct contexts' keys
# >= 1e-5, docs/rome.md); every key must still gain the full residual to within _CONSTRAINT_ATOL (there: <= 2e-7).
_GRAM_RTOL = 1e-10
_CONSTRAINT_ATOL = 1e-4


def solve_second_moment(second_moment: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """``C⁻¹ k`` in float64, for one key or a stack of them.

    Args:
        second_moment: ``C`` ``[d_in, d_in]``, symmetric positive definite.
        key: ``k`` ``[d_in]``, or ``P`` keys ``[P, d_in]``.

    Returns:
        ``[d_in]`` (or ``[P, d_in]``: row ``j`` is ``C⁻¹ k_j``) float64.

    Raises:
        StatisticsError: ``C`` has the wrong shape, is singular, or is not finite.
    """
    d = key.shape[-1]
    if second_moment.shape != (d, d):
        raise StatisticsError(
            f"Second moment of shape {tuple(second_moment.shape)} does not match keys of size {d}: "
            f"compute the statistics at the edited layer's input node"
        )
    c = second_moment.to(torch.float64)
    k = key.to(device=c.device, dtype=torch.float64)
    columns = k.unsqueeze(-1) if k.dim() == 1 else k.T  # [d_in, 1] or [d_in, P]
    try:
        factor = torch.linalg.cholesky(c)
        solution = torch.cholesky_solve(columns, factor)
    except RuntimeError:
        try:
            solution = torch.linalg.solve(c, columns)
        except RuntimeError as exc:
            raise StatisticsError(
                f"The second moment is singular ({exc}); compute it over more text (raise n_samples)"
            ) from None
    if not torch.isfinite(solution).all():
        raise StatisticsError("C⁻¹k is not finite; recompute the statistics over more text (raise n_samples)")
    return solution.squeeze(-1) if k.dim() == 1 else solution.T


def rank_one_factors(
    weight: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    second_moment: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Factors ``(u, v)`` of the ROME update ``W' = W + v uᵀ`` (eq. 2).

    Args:
        weight: ``W`` ``[d_out, d_in]`` in the paper's orientation (for GPT-2 ``Conv1D`` pass ``weight.T``).
        key: ``k*`` ``[d_in]``.
        value: ``v*`` ``[d_out]``, the desired ``W' k*`` (bias excluded).
        second_moment: ``C`` ``[d_in, d_in]``.

    Returns:
        ``u`` ``[d_in]`` and ``v`` ``[d_out]``, float64: ``u = C⁻¹k*/(k*ᵀC⁻¹k*)``, ``v = v* - W k*``.

    Raises:
        StatisticsError: ``C`` is unusable, or ``k*ᵀ C⁻¹ k* <= 0``.
        ValueError: shapes disagree.
    """
    d_out, d_in = weight.shape
    if key.shape != (d_in,) or value.shape != (d_out,):
        raise ValueError(
            f"W is [{d_out}, {d_in}] but k* is {tuple(key.shape)} and v* is {tuple(value.shape)}; "
            f"expected k* [{d_in}] and v* [{d_out}]"
        )
    k = key.to(dtype=torch.float64)
    w = weight.detach().to(device=k.device, dtype=torch.float64)
    return rank_one_update(key, value.detach().to(device=k.device, dtype=torch.float64) - w @ k, second_moment)


def rank_one_update(key: torch.Tensor, residual: torch.Tensor, second_moment: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Factors ``(u, v)`` of the ROME update from the residual ``v* - W k*`` directly (eq. 2): what the layer's
    output at ``k*`` must gain. ROME's value search finds that residual as ``δ``, so no weight is read: this is
    how layers whose weights cannot be read as a matrix (quantized, offloaded) are edited.

    Args:
        key: ``k*`` ``[d_in]``, or the contexts' keys ``[P, d_in]`` (see :func:`update_direction`).
        residual: ``v* - W k*`` ``[d_out]``.
        second_moment: ``C`` ``[d_in, d_in]``.

    Returns:
        ``u`` (:func:`update_direction`) ``[d_in]`` and ``v = residual`` ``[d_out]``, float64.

    Raises:
        StatisticsError: as :func:`update_direction`.
    """
    u = update_direction(key, second_moment)
    return u, residual.detach().to(device=u.device, dtype=torch.float64)


def update_direction(key: torch.Tensor, second_moment: torch.Tensor) -> torch.Tensor:
    """The key factor ``u`` of the ROME update ``W' = W + v uᵀ`` (eq. 2), ``u = C⁻¹k*/(k*ᵀC⁻¹k*)``. It does not
    depend on the value, so an editor can check it before the value search.

    **Keys per context.** Given the keys of ``P`` contexts ``K`` (``[P, d_in]``, rows ``k_j``) instead of their
    average, ``u = C⁻¹Kᵀ (K C⁻¹ Kᵀ)⁻¹ 1``: the update of least ``C``-norm with ``uᵀ k_j = 1`` for every context, so
    every context's output gains the full residual (the average key's update only guarantees it for the average; a
    context whose key is far from it, such as a subject at position 0, barely moves). Every context shares the
    residual ``δ``, so the update stays rank one; ``P = 1`` is eq. 2. The Gram matrix ``K C⁻¹ Kᵀ`` is inverted by
    pseudo-inverse, so keys that are equal up to float32 rounding (a key given twice) count as one key.

    Args:
        key: ``k*`` ``[d_in]``, or the contexts' keys ``[P, d_in]``.
        second_moment: ``C`` ``[d_in, d_in]``.

    Returns:
        ``u`` ``[d_in]``, float64.

    Raises:
        StatisticsError: ``C`` is unusable, ``k*ᵀ C⁻¹ k* <= 0``, or the contexts' keys are linearly dependent in a
            way no rank-one update can serve (e.g. ``k_3 = k_1 + k_2``, which would need ``uᵀk_3 = 2``).
    """
    c_inv_k = solve_second_moment(second_moment, key)  # [d_in] or [P, d_in]
    k = key.to(device=c_inv_k.device, dtype=torch.float64)
    if k.dim() == 2:
        gram = k @ c_inv_k.T  # [P, P]: k_iᵀ C⁻¹ k_j, symmetric positive semi-definite
        ones = torch.ones(len(k), dtype=torch.float64, device=k.device)
        weights = torch.linalg.pinv(gram, rtol=_GRAM_RTOL, hermitian=True) @ ones  # equal keys count once
        missed = float((gram @ weights - ones).abs().max())  # max_j |uᵀ k_j - 1|
        if not missed <= _CONSTRAINT_ATOL:
            raise StatisticsError(f"The contexts' keys are linearly dependent and no rank-one update gives each the "
                                  f"full residual (max |uᵀk_j - 1| = {missed:.3g}); use the averaged key "
                                  f"(keys_per_context=False) or fewer context prefixes")
        return weights @ c_inv_k
    denom = torch.dot(c_inv_k, k)
    if not bool(denom > 0):
        raise StatisticsError(f"k*ᵀ C⁻¹ k* = {denom.item():.3g} is not positive; "
                              f"the statistics are not positive definite")
    return c_inv_k / denom
