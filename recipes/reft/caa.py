"""Contrastive activation addition (CAA): a steering vector as a mean difference of activations.

Rimsky et al. 2024 ("Steering Llama 2 via Contrastive Activation Addition", arXiv 2312.06681, section 3) take the
mean, over contrast pairs, of the difference between the residual-stream activations at the answer token of the
positive and of the negative completion. With free-text continuations (``{"prompt", "chosen", "rejected"}``) the
answer is several tokens: each continuation's activation is the mean over its tokens (teacher-forced after the
prompt), and the vector is mean(chosen) − mean(rejected) over the records. It is the baseline BiPO is compared with.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from gradpatch.errors import SubspaceConfigError
from gradpatch.patches import ProbePatch

from ..generation import graph_logits
from ..tokens import left_pad
from .continuations import PreferenceRecord

__all__ = ["caa_vector", "continuation_mean_activations"]


@torch.no_grad()
def continuation_mean_activations(module: Any, node: str, prompts: Sequence[str],
                                  responses: Sequence[str]) -> torch.Tensor:
    """The activation at ``node`` averaged over each continuation's tokens, without any intervention: ``[B, d]``
    float32.

    Args:
        module: a :class:`~recipes.reft.module.ReFTModule` (its frozen graph, tokenizer and ``encode``).
        node: NodePath of a ``[batch, seq, d]`` activation.
        prompts, responses: ``B`` pairs.

    Raises:
        RecipeConfigError: an empty continuation.
        NodePathError: an unknown node.
    """
    tokenized = module.encode(prompts, responses)
    probe = ProbePatch()
    with module.graph.patch({node: probe}):
        graph_logits(module.graph, left_pad(tokenized.ids, module.pad_id), {"use_cache": False})
    activation = probe.activation.float()  # [B, S, d]
    width = activation.shape[1]
    column = torch.arange(width, device=activation.device)[None, :]
    lengths = torch.tensor(tokenized.response_lengths, device=activation.device)[:, None]
    mask = (column >= width - lengths).float()[..., None]
    return (activation * mask).sum(1) / mask.sum(1)


def caa_vector(module: Any, node: str, records: Sequence[PreferenceRecord], batch_size: int = 16) -> torch.Tensor:
    """CAA's steering vector at ``node``: mean over records of (mean activation over the chosen continuation − the
    same over the rejected one): ``[d]`` float32.

    Raises:
        SubspaceConfigError: no records.
        RecipeConfigError: an empty continuation.
    """
    if not records:
        raise SubspaceConfigError("caa_vector needs at least one preference record")
    total = None
    for start in range(0, len(records), batch_size):
        chunk = records[start:start + batch_size]
        prompts = [r.prompt for r in chunk]
        difference = (continuation_mean_activations(module, node, prompts, [r.chosen for r in chunk])
                      - continuation_mean_activations(module, node, prompts, [r.rejected for r in chunk])).sum(0)
        total = difference if total is None else total + difference
    return total / len(records)
