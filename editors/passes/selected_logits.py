"""Logits at chosen positions only: the output embedding runs on the hidden states it is asked about.

A language model computes ``[batch, seq, vocab]`` logits; an objective that reads a few positions per row (the target
tokens and the KL prompt's last token of ROME's value objective, eq. 4 of Meng et al. 2022) needs a fraction of
them. For SmolLM2-135M (vocabulary 49,152) a batch of 1,000 rows of 20 tokens would hold 3.9 GB of float32 logits
and spend a fifth of the forward pass in the output embedding. :func:`logits_at` patches the output embedding's
input node with a :class:`gradpatch.CustomPatch` that keeps the hidden states at ``(rows, cols)`` only, so the
output embedding computes ``[n, vocab]``; the other positions are never projected. Models whose output embedding is
not a linear layer found by ``get_output_embeddings()`` fall back to the full logits, then indexed.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from gradpatch import CustomPatch
from gradpatch.model_io import logits_of, model_device, wrapped_model

from ..errors import LayerKindError
from ..layers import resolve_layer
from .scoring import mean_target_logprobs

__all__ = ["logits_at", "output_embedding_input_node", "target_logprobs_at"]


def output_embedding_input_node(pg: nn.Module) -> str | None:
    """NodePath of the input of the model's output embedding (``"lm_head.input"`` for Llama and GPT-2), or ``None``
    when the model has no ``get_output_embeddings()`` linear layer reachable as a graph node."""
    model = wrapped_model(pg)
    getter = getattr(model, "get_output_embeddings", None)
    head = getter() if callable(getter) else None
    if not isinstance(head, nn.Module):
        return None
    name = next((n for n, m in model.named_modules() if m is head), None)
    if not name:
        return None
    path = re.sub(r"\.(\d+)(?=\.|$)", r"_\1", name)  # model.layers.3 -> model.layers_3
    try:
        return resolve_layer(pg, path).input_node
    except (KeyError, LayerKindError):
        return None


def logits_at(pg: nn.Module, input_ids: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor,
              patches: Mapping[str, Any] | None = None, head_node: str | None = None,
              model_kwargs: Mapping[str, Any] | None = None) -> torch.Tensor:
    """Logits at positions ``(rows[i], cols[i])`` of a forward pass of ``pg`` with ``patches`` applied.

    Args:
        pg: the model's :class:`gradpatch.PatchableGraph`.
        input_ids: ``[batch, seq]`` token ids (right-padded batches need no attention mask).
        rows: ``[n]`` batch indices; cols: ``[n]`` sequence positions.
        patches: more patches for the pass (NodePath -> patch or list of patches); differentiable values stay so.
        head_node: :func:`output_embedding_input_node` of ``pg`` (looked up when ``None``; pass it to save the look-up
            in a loop). Without such a node the full logits are computed and indexed.
        model_kwargs: more arguments of the forward pass (``attention_mask``, ``position_ids``, ``past_key_values``:
            :class:`editors.passes.prefix_cache.PrefixCache`); default ``use_cache=False``.

    Returns:
        ``[n, vocab]`` logits, in the model's dtype (differentiable with respect to the patch values).
    """
    mapping: dict[str, Any] = dict(patches or {})
    node = head_node if head_node is not None else output_embedding_input_node(pg)
    kwargs = dict(model_kwargs) if model_kwargs is not None else {"use_cache": False}
    if node is None:
        with pg.patch(mapping):
            return logits_of(pg(input_ids=input_ids, **kwargs))[rows, cols]
    gather = CustomPatch(custom_op=lambda hidden: hidden[rows, cols].unsqueeze(0))  # [1, n, d_model]
    existing = mapping.get(node, [])
    mapping[node] = [*(existing if isinstance(existing, list) else [existing]), gather]
    with pg.patch(mapping):
        return logits_of(pg(input_ids=input_ids, **kwargs))[0]


def target_logprobs_at(pg: nn.Module, tokenizer: Any, prompts: Sequence[str], targets: Sequence[str],
                       batch_size: int = 64) -> torch.Tensor:
    """:func:`editors.passes.scoring.mean_target_logprobs` on ``pg`` with the output embedding and the softmax run at the
    target tokens' positions only (:func:`logits_at`).

    Args:
        pg: the model's PatchableGraph (active patches apply).
        tokenizer: its tokenizer.
        prompts: ``n`` prompts without trailing space; targets: ``n`` targets without leading space.
        batch_size: prompt/target pairs per forward pass (right-padded).

    Returns:
        ``[n]`` float32 on the CPU.

    Raises:
        ValueError: ``prompts`` and ``targets`` differ in length.
    """
    device, head = model_device(pg), output_embedding_input_node(pg)

    def forward_at(ids: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        return logits_at(pg, ids.to(device), rows.to(device), cols.to(device), head_node=head)

    return mean_target_logprobs(lambda ids: pg(ids.to(device), use_cache=False), tokenizer, prompts, targets,
                                batch_size=batch_size, forward_at=forward_at)
