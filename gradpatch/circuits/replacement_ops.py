"""The patches' operations of :class:`~gradpatch.circuits.replacement.ReplacementModel`'s forward pass: each
function returns the ``custom_op`` of a :class:`~gradpatch.patches.CustomPatch` that replaces one node's value by the
replacement model's (recorded, frozen, linearised or the transcoder's output), as
:meth:`~gradpatch.circuits.replacement.ReplacementModel.run` applies them (the module docstring of
:mod:`gradpatch.circuits.replacement` gives the equations)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..dictionaries import TranscoderInput
from ..patches import HoldPatch
from .freeze import FrozenLayerNorm, FrozenPattern, LinearisedOp

__all__ = ["frozen_op", "layer_norm_op", "linearised_op", "output_op", "pattern_op", "recorded_op"]


def recorded_op(recorded: torch.Tensor) -> Any:
    """The recorded value ``recorded`` (e.g. at no position), whatever the node's live value (for a computation
    whose result is replaced)."""
    def replay(original: torch.Tensor) -> torch.Tensor:
        return recorded.to(original.dtype)
    return replay


def frozen_op(recorded: torch.Tensor) -> Any:
    """A frozen node's replacement in a run of the first positions: the recorded value cut to the live value's
    sizes (``ReplacementModel.run``'s ``length``), broadcast to it as :class:`~gradpatch.patches.ReplacePatch`
    does."""
    def frozen(original: torch.Tensor) -> torch.Tensor:
        cut = recorded[tuple(slice(0, size) for size in original.shape)] if recorded.dim() == original.dim() \
            else recorded
        return cut.to(original.dtype).expand(original.shape).contiguous()
    return frozen


def pattern_op(reader: HoldPatch, a0: torch.Tensor) -> Any:
    """An SDPA call's replacement: its own value (bit for bit: v − v is 0) plus A⁰ (v − v) with v read live by
    ``reader``, so that the gradient reaching v is A⁰ᵀ g (:meth:`FrozenPattern.mixed`) and SDPA's backward
    never runs."""
    def mixed(original: torch.Tensor) -> torch.Tensor:
        value = reader.held
        return original.detach() + FrozenPattern.mixed(a0.to(value.dtype), value - value.detach())
    return mixed


def layer_norm_op(norm: FrozenLayerNorm, reader: HoldPatch, x0: torch.Tensor, y0: torch.Tensor,
                  sigma0: torch.Tensor) -> Any:
    """A ``layer_norm`` op's replacement with its scale frozen (:meth:`FrozenLayerNorm.frozen`)."""
    def frozen(original: torch.Tensor) -> torch.Tensor:
        return norm.frozen(reader.held, x0, y0, sigma0).to(original.dtype)
    return frozen


def linearised_op(reader: HoldPatch, z0: torch.Tensor, y0: torch.Tensor, slope: torch.Tensor) -> Any:
    """An elementwise op's replacement by its tangent at the prompt, y⁰ + f′(z⁰) ⊙ (z − z⁰) with z read live by
    ``reader`` (:meth:`LinearisedOp.linearised`). Where the unembedding runs on the last positions alone
    (:mod:`gradpatch.circuits.backward`), z ``[batch, k, ...]`` is compared with the last k positions of the
    recorded ``[1, seq, ...]``."""
    def tangent(original: torch.Tensor) -> torch.Tensor:
        k = original.shape[1]
        z_0, y_0, slope_0 = (t[:, t.shape[1] - k:] for t in (z0, y0, slope))
        return LinearisedOp.linearised(reader.held, z_0, y_0, slope_0).to(original.dtype)
    return tangent


def output_op(spliced: Any, reader: TranscoderInput, delta: torch.Tensor | None,
              first: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """The MLP output's replacement ``[batch, length, d_out]``, c_ℓ + x_ℓ W_skipᵀ + δ_ℓ with x_ℓ read live by
    ``reader``, computed as y_ℓ + (x_ℓ − x_ℓ⁰) W_skipᵀ + δ_ℓ (x_ℓ⁰ the recorded input; y_ℓ and x_ℓ⁰ at the
    positions run, as ``first`` cuts them): the same value and gradient, and y_ℓ bit for bit when nothing is
    perturbed. Without a skip term or δ_ℓ the value is a leaf requiring gradients where autograd is on (the
    gradient at the MLP output is read there). ``spliced``: the layer's
    :class:`~gradpatch.circuits.replacement.SplicedLayer` (its transcoder, recorded inputs and outputs)."""
    with torch.no_grad():
        skip_recorded = spliced.transcoder.skip(first(spliced.inputs))
    recorded = first(spliced.outputs)

    def output(original: torch.Tensor) -> torch.Tensor:
        shape = (*reader.held.shape[:-1], recorded.shape[-1])  # the MLP may have run on no position
        value = recorded.to(original.dtype).expand(shape)
        if skip_recorded is not None:
            value = value + (spliced.transcoder.skip(reader.held) - skip_recorded).to(original.dtype)
        if delta is not None:
            return value + delta.to(original.dtype)
        if torch.is_grad_enabled() and not value.requires_grad:  # no skip term: a leaf, so gradients reach it
            value = value.clone().requires_grad_()
        return value
    return output
