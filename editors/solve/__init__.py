"""The closed forms: ROME's rank-one update (Meng et al. 2022, arXiv 2202.05262, eq. 2:
``W' = W + (v* - W k*) (C⁻¹k*)ᵀ / ((C⁻¹k*)ᵀ k*)``, :mod:`.rank_one`) and the many-fact updates of MEMIT (arXiv
2210.07229, eq. 14) and AlphaEdit (arXiv 2410.02355, §3, the null-space projected update), :mod:`.multi_update`.

Names are imported on first use (:func:`editors.lazy.lazy_exports`).
"""

from __future__ import annotations

from ..lazy import lazy_exports

#: Public name -> submodule that defines it.
_EXPORTS: dict[str, str] = {
    "added": "multi_update",
    "alphaedit_factors": "multi_update",
    "memit_factors": "multi_update",
    "null_space_projector": "multi_update",
    "rank_one_factors": "rank_one",
    "rank_one_update": "rank_one",
    "solve_second_moment": "rank_one",
    "update_direction": "rank_one",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
