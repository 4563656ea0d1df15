"""The value search's passes from the residual stream after the edited block: the layers up to it run once per row.

ROME's and MEMIT's value objective (Meng et al. 2022, §3.1, eq. 4; Meng et al. 2023, §4.3, eq. 16) adds ``δ`` to the
output of the edited layer ``L`` (an MLP's output projection) at the subject's last token ``s``. With the prefix cache
(:mod:`editors.passes.prefix_cache`) a step runs each row's tokens from ``s`` on; at those tokens, too, nothing up to the
residual stream after block ``L`` depends on ``δ`` except that stream at ``s`` itself, which is ``h_L[s] + δ``: the MLP's
output is added to the residual stream (MEMIT's eq. 7), and attention in blocks ``≤ L`` reads the stream before
``δ`` is added. :class:`TailPass` keeps ``h_L`` at each row's tokens from ``s`` on (computed once, with the engine, at
the row's first step) and runs only the blocks after ``L``, the final norm and the output embedding at the positions
the objective reads, on ``h_L`` with ``δ`` added at ``s``. A SmolLM2-135M step edited at block 6 of 30 skips the
forward pass of seven blocks for those tokens (the backward pass never ran through them: nothing there depends on
``δ``, and the search freezes the weights).

It runs the model's own decoder (transformers' ``get_decoder()``, with ``inputs_embeds`` and the prefix cache) with
its ``layers`` list cut to the blocks after ``L`` for the call, so it is only for a model nobody else runs meanwhile:
the value search's own copy (:class:`editors.value.search_copy.SearchCopy`). Whether adding ``δ`` to the residual stream is
what the patch at ``L``'s output does depends on the architecture (a norm after the MLP, as in Gemma 2, breaks it):
the value search compares the two on its first rows (:func:`logits_match`, :meth:`TailPass.adds_to_stream`) before
it relies on it.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Hashable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from gradpatch import AddPatch
from gradpatch.capture import node_activations
from gradpatch.model_io import wrapped_model

from ..layers import resolve_module
from .prefix_cache import quiet_extraction

__all__ = ["TailPass", "logits_match", "tail_pass_for"]

#: Largest difference allowed between a tail pass's logits and the full pass's, as a share of the largest logit
#: (:func:`logits_match`).
LOGIT_TOLERANCE = 1e-3
#: Largest relative difference allowed between the change the patch makes to the residual stream and ``δ``
#: (:meth:`TailPass.adds_to_stream`).
STREAM_TOLERANCE = 0.05


class TailPass:
    """Blocks ``start …`` of a transformers decoder-only language model, its final norm and output embedding, run on
    the residual stream entering block ``start``.

    Args:
        pg: the model's PatchableGraph (it computes the residual stream ``h_L`` of the rows).
        residual_node: NodePath of the stream after block ``start − 1``, e.g. ``"model.layers_6.output"``.

    Raises:
        ValueError: the model has no decoder with a ``layers`` list holding that block, or its output embedding is not
            a linear layer (the value search then runs full passes).
    """

    def __init__(self, pg: nn.Module, residual_node: str) -> None:
        model = wrapped_model(pg)
        decoder = model.get_decoder() if callable(getattr(model, "get_decoder", None)) else None
        layers = getattr(decoder, "layers", None)
        head = model.get_output_embeddings() if callable(getattr(model, "get_output_embeddings", None)) else None
        block_path = re.sub(r"\.output$", "", residual_node)
        try:
            block = resolve_module(pg, block_path)
        except KeyError:
            block = None
        index = next((i for i, layer in enumerate(layers) if layer is block), None) if isinstance(
            layers, nn.ModuleList) else None
        if index is None or not isinstance(head, nn.Linear):
            raise ValueError(f"{type(model).__name__} has no decoder whose layers list holds {block_path!r} and "
                             f"ends in a linear output embedding; run the value search with full passes")
        self.pg, self.residual_node = pg, residual_node
        self.decoder: nn.Module = decoder
        self.layers: nn.ModuleList = layers
        self.head: nn.Linear = head
        self.start = index + 1
        self._hidden: dict[Hashable, torch.Tensor] = {}  # row key -> h_L at its tokens from s on, [S_row, d_model]

    def holds(self, keys: Sequence[Hashable]) -> bool:
        """Whether ``h_L`` of every row in ``keys`` is kept (:meth:`fill` has nothing to do)."""
        return all(key in self._hidden for key in keys)

    def fill(self, keys: Sequence[Hashable], lengths: Sequence[int], model_inputs: Mapping[str, Any]) -> None:
        """Compute ``h_L`` of the rows, one no-grad pass of the engine up to ``residual_node``, and keep it for the rows
        not kept yet (a caller checks :meth:`holds` first: building ``model_inputs`` copies the prefixes' cache).

        Args:
            keys: the rows' keys; lengths: their suffix lengths (tokens from ``s`` on).
            model_inputs: a pass of the rows (:meth:`editors.passes.prefix_cache.PrefixCache.inputs`; its cache is used up).
        """
        inputs = dict(model_inputs)
        with quiet_extraction():
            (hidden,) = node_activations(self.pg, [self.residual_node], inputs.pop("input_ids"), **inputs)  # [R, S, d]
        for i, (key, length) in enumerate(zip(keys, lengths)):
            self._hidden.setdefault(key, hidden[i, :length].clone())

    def discard(self, keys: Sequence[Hashable]) -> None:
        """Forget the rows' ``h_L`` (rows that will not run again)."""
        for key in keys:
            self._hidden.pop(key, None)

    def logits(self, keys: Sequence[Hashable], delta: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor,
               model_inputs: Mapping[str, Any]) -> torch.Tensor:
        """Logits at ``(rows[i], cols[i])`` with ``delta[r]`` added to row ``r``'s stream at its first token ``s``.

        Args:
            keys: the ``R`` rows' keys (filled by :meth:`fill`).
            delta: ``[R, d_model]`` (differentiable).
            rows, cols: ``[n]`` positions in the rows' suffixes.
            model_inputs: the rows' pass (:meth:`editors.passes.prefix_cache.PrefixCache.inputs`; ``input_ids`` is ignored).

        Returns:
            ``[n, vocab]`` logits in the model's dtype.
        """
        states = [self._hidden[key] for key in keys]
        hidden = states[0].new_zeros((len(states), int(model_inputs["input_ids"].shape[1]), states[0].shape[-1]))
        for i, state in enumerate(states):
            hidden[i, : len(state)] = state
        first = hidden[:, :1] + delta.to(hidden.dtype).unsqueeze(1)
        embeds = torch.cat([first, hidden[:, 1:]], dim=1)  # [R, S, d_model]
        kwargs = {name: value for name, value in model_inputs.items() if name != "input_ids"}
        with self._blocks_after():
            output = self.decoder(inputs_embeds=embeds, **kwargs)
        return self.head(output.last_hidden_state[rows, cols])  # an index is contiguous: one [n, d] @ [d, vocab]

    def adds_to_stream(self, model_inputs: Mapping[str, Any], output_node: str, keys: Sequence[Hashable]) -> bool:
        """Whether an :class:`gradpatch.AddPatch` of ``output_node`` at each row's first token changes the residual
        stream at ``residual_node`` there by what it adds (up to :data:`STREAM_TOLERANCE` of its norm), as
        :meth:`logits` assumes; a norm after the patched layer (as in Gemma 2) breaks it. The added vector is as long
        as the stream there (a smaller one drowns in the rounding of the stream's large coordinates).

        Args:
            model_inputs: a pass of the rows (:meth:`editors.passes.prefix_cache.PrefixCache.inputs`; its cache is used up).
            output_node: the edited layer's output node; keys: the rows (filled by :meth:`fill`).
        """
        unpatched = torch.stack([self._hidden[key][0] for key in keys]).float()  # [R, d_model]
        direction = torch.ones_like(unpatched) / unpatched.shape[-1] ** 0.5
        delta = direction * unpatched.norm(dim=-1, keepdim=True)
        rows = torch.arange(len(keys), device=delta.device)
        patch = AddPatch(value=delta, slice=(rows, torch.zeros_like(rows)))
        inputs = dict(model_inputs)
        with quiet_extraction():
            (patched,) = node_activations(self.pg, [self.residual_node], inputs.pop("input_ids"),
                                          patches={output_node: patch}, **inputs)  # [R, S, d_model]
        error = (patched[:, 0].float() - unpatched - delta).norm()
        return bool(error <= STREAM_TOLERANCE * delta.norm())

    @contextlib.contextmanager
    def _blocks_after(self) -> Iterator[None]:
        """The decoder's ``layers`` cut to the blocks from :attr:`start` on, for the block (each keeps its
        ``layer_idx``: the cache holds every block's prefix)."""
        self.decoder.layers = self.layers[self.start :]
        try:
            yield
        finally:
            self.decoder.layers = self.layers


def tail_pass_for(pg: nn.Module, residual_node: str) -> TailPass | None:
    """A :class:`TailPass` of ``pg`` after ``residual_node``'s block, or ``None`` where the model has none."""
    try:
        return TailPass(pg, residual_node)
    except ValueError:
        return None


def logits_match(tail_logits: torch.Tensor, full_logits: torch.Tensor) -> bool:
    """Whether a tail pass's logits are the full pass's at the same ``δ`` (both ``[n, vocab]``), up to
    :data:`LOGIT_TOLERANCE` of the largest logit."""
    error = (tail_logits.float() - full_logits.float()).abs().max()
    return bool(error <= LOGIT_TOLERANCE * full_logits.float().abs().max())
