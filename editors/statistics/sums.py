"""The accumulate step of the second moment ``C = E[k kᵀ]`` (:mod:`editors.statistics.second_moment`): running sums
``Σ a_t k_t k_tᵀ`` of the edited layers' keys over corpus batches, and the weight ``Σ a_t`` they are divided by.

Every token counts once (``a_t = 1``) at a linear layer; an expert of an MoE block weighs the tokens routed to it 1
and the others :data:`editors.layers.experts.UNROUTED_KEY_WEIGHT`
(:meth:`editors.layers.experts.ExpertLayer.key_weights`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from gradpatch.capture import node_activations
from gradpatch.model_io import model_device, pad_token_id, right_pad

from ..errors import StatisticsError
from ..layers import LinearLayer

__all__ = ["SecondMomentSums"]


class SecondMomentSums:
    """Running sums ``Σ a_t k kᵀ`` of several layers' keys and their weights: the accumulate step of
    :func:`~editors.statistics.second_moment.compute_second_moments`, also held by each rank of a distributed job
    (``recipes.stats_job``, which divides by :attr:`n_tokens`: linear layers only).

    Pad positions and special tokens (BOS/EOS) are left out. Sums live on each layer's device in
    ``accumulate_dtype``; memory is one ``[d_in, d_in]`` accumulator per layer plus one batch of activations.

    Args:
        pg: the model's :class:`gradpatch.PatchableGraph`.
        tokenizer: its tokenizer (pad and special token ids).
        layers: the layers whose keys are accumulated (:class:`LinearLayer` or
            :class:`editors.layers.experts.ExpertLayer`).
        accumulate_dtype: float64 (default) or float32.

    Attributes:
        totals: ``Σ a_t k kᵀ`` ``[d_in, d_in]`` per layer.
        weights: ``Σ a_t`` per layer (the token count at a linear layer).
        n_tokens: tokens added.
    """

    def __init__(self, pg: nn.Module, tokenizer: Any, layers: Sequence[LinearLayer],
                 accumulate_dtype: torch.dtype = torch.float64) -> None:
        self.pg, self.layers, self.accumulate_dtype = pg, list(layers), accumulate_dtype
        self.pad = pad_token_id(tokenizer)
        self.special = torch.tensor(sorted(set(getattr(tokenizer, "all_special_ids", []) or [])), dtype=torch.long)
        self.totals = [torch.zeros(layer.d_in, layer.d_in, dtype=accumulate_dtype, device=layer.device)
                       for layer in self.layers]
        self.weights = [0.0 for _ in self.layers]
        self.n_tokens = 0

    def add(self, docs: Sequence[Sequence[int]]) -> bool:
        """One forward pass over ``docs`` (non-empty token id lists, right-padded into ``[batch, seq]``), stopped
        after the last layer's input; ``a_t k kᵀ`` of every kept token added in place (no ``[d_in, d_in]`` temporary).

        Returns:
            Whether every added key was finite (the sums hold NaN or inf otherwise).
        """
        ids, lengths = right_pad(docs, self.pad)
        keep = torch.arange(ids.shape[1]).unsqueeze(0) < lengths.unsqueeze(1)
        if self.special.numel():
            keep &= ~torch.isin(ids, self.special)
        nodes = list(dict.fromkeys(layer.input_node for layer in self.layers))  # experts of one block share theirs
        read = dict(zip(nodes, node_activations(self.pg, nodes, ids.to(model_device(self.pg)))))
        finite = True
        for i, (layer, total) in enumerate(zip(self.layers, self.totals)):
            activations = read[layer.input_node]  # [batch, seq, d]
            kept = activations[keep.to(activations.device)]  # [tokens, d]
            with torch.no_grad():
                k = layer.keys_of(kept).to(device=total.device, dtype=self.accumulate_dtype)  # [tokens, d_in]
                a = layer.key_weights(kept)  # [tokens] or None (each token once)
            finite = finite and bool(torch.isfinite(k).all())
            if a is None:
                total.addmm_(k.T, k)
                self.weights[i] += len(k)
            else:
                a = a.to(device=total.device, dtype=self.accumulate_dtype)
                total.addmm_((k * a.unsqueeze(1)).T, k)
                self.weights[i] += float(a.sum())
        self.n_tokens += int(keep.sum())
        return finite

    def means(self) -> list[torch.Tensor]:
        """``C = Σ a_t k kᵀ / Σ a_t`` ``[d_in, d_in]`` float64 per layer.

        Raises:
            StatisticsError: no token was added.
        """
        if self.n_tokens == 0:
            raise StatisticsError("The corpus gave no token; pass a corpus with text (a file, or a list of strings)")
        return [(total / weight).to(torch.float64) for total, weight in zip(self.totals, self.weights)]
