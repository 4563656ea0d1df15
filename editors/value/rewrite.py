"""Whether a computed edit wins on its own rewrite prompt, measured as efficacy measures it (Meng et al. 2022, §4.2:
``P(target_new) > P(target_true)`` after ``prompt``), with the edit as patches on the unchanged weights.

A value search can meet its loss threshold while the edit it yields loses there: the search reads the model at the
prompts and positions it optimises, the efficacy score at the bare rewrite prompt under the weight change. ROME records
this check in ``edit.info["rewrite"]`` and reports such an edit as not converged (``converged: false``), so
:meth:`editors.ROME.edit` refuses it (:class:`~editors.errors.EditNotConvergedError`) unless asked to apply it anyway.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..edits.patches import layer_patches
from ..layers import LinearLayer
from ..passes.selected_logits import target_logprobs_at
from ..requests import EditRequest

__all__ = ["rewrite_check"]


@torch.no_grad()
def rewrite_check(pg: nn.Module, tokenizer: Any, layer: LinearLayer, request: EditRequest, u: torch.Tensor,
                  v: torch.Tensor) -> dict[str, Any] | None:
    """Score the rewrite prompt under the rank-one edit ``W' = W + v uᵀ`` (applied as patches, weights untouched).

    Args:
        pg: the model's :class:`gradpatch.PatchableGraph`.
        tokenizer: the editor's tokenizer (the one that scores the edit: start token included).
        layer: the edited layer.
        request: the fact; without ``target_true`` there is nothing to compare and ``None`` is returned.
        u: ``[d_in]``; v: ``[d_out]`` (the edit's factors).

    Returns:
        ``{"logp_new", "logp_true", "wins"}``: the mean token log-probabilities of ``target_new`` and ``target_true``
        after ``request.text`` under the edit, and whether the new one is higher; ``None`` without ``target_true``.
    """
    if not request.target_true:
        return None
    with pg.patch(layer_patches(layer, u, v)):
        new, true = target_logprobs_at(pg, tokenizer, [request.text] * 2,
                                       [request.target_new, request.target_true]).tolist()
    return {"logp_new": new, "logp_true": true, "wins": new > true}
