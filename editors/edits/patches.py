"""An edit as patches: ``y' = y + v (uᵀ k)`` (rank one) or ``y' = y + V (Uᵀ k)`` (rank r) at the layer's output, for
the layer's input ``k``.

Writing ``W' = W + v uᵀ`` changes the output of the layer for every input ``k`` by ``v uᵀ k``. The same change
made by patches — one recording the layer input, one adding ``v (uᵀ k)`` to the output — leaves the weight
untouched, so it reaches weights that cannot be written (bitsandbytes' 8-bit/4-bit storage, accelerate-offloaded
layers), composes with other patches, and is undone by leaving the patch block (ROME, Meng et al. 2022, eq. 2; the
rank-r updates of MEMIT, arXiv 2210.07229 eq. 14, and AlphaEdit alike).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from gradpatch import Patch, ReplacePatch

from ..layers import ExpertLayer
from ..layers import LinearLayer

__all__ = ["ExpertLowRankAdd", "KeyCapture", "LowRankAdd", "layer_patches", "low_rank_patches",
           "updated_weight_patches"]


@dataclass(kw_only=True)
class KeyCapture(Patch):
    """Keeps the layer input of the current forward pass (unchanged, with its autograd history) for
    :class:`LowRankAdd`.

    Attributes:
        keys: holds the last input seen, ``[..., d_in]``.
    """

    keys: list[torch.Tensor] = field(default_factory=list, repr=False)
    requires_clone: bool = field(default=False, init=False, repr=False)

    def op(self, original: torch.Tensor) -> torch.Tensor:
        self.keys[:] = [original]
        return original


@dataclass(kw_only=True)
class LowRankAdd(Patch):
    """Adds ``v (uᵀ k)`` (or ``V (Uᵀ k)``) to the layer output, ``k`` the input captured by ``capture`` in the same
    forward pass.

    Attributes:
        capture: the :class:`KeyCapture` at the layer's input node.
        u: ``[d_in]`` or ``[d_in, r]``; v: ``[d_out]`` or ``[d_out, r]`` (any float dtype; the change is computed in
            float64 and added in the activation's dtype).
    """

    capture: KeyCapture
    u: torch.Tensor
    v: torch.Tensor
    requires_clone: bool = field(default=False, init=False, repr=False)

    def op(self, original: torch.Tensor) -> torch.Tensor:
        if not self.capture.keys:
            raise RuntimeError("the low-rank patch at the output ran before its key capture at the input")
        change = _low_rank_change(self.capture.keys.pop(), self.u, self.v, original.device)
        return original + change.to(original.dtype)


def _low_rank_change(keys: torch.Tensor, u: torch.Tensor, v: torch.Tensor, device: torch.device,
                    weight: torch.Tensor | None = None) -> torch.Tensor:
    """``V (Uᵀ k)`` for keys ``[..., d_in]`` (``u`` ``[d_in]`` or ``[d_in, r]``, ``v`` ``[d_out]`` or ``[d_out, r]``),
    each row times ``weight`` ``[...]`` where given, ``[..., d_out]`` on ``device`` in float64: computed and rounded
    once, the same precision as the weight write (``W + v uᵀ`` in float64, then cast)."""
    scale = keys.to(torch.float64) @ u.to(device=keys.device, dtype=torch.float64)  # [...] or [..., r]
    if weight is not None:
        weight = weight.to(device=keys.device, dtype=torch.float64)
        scale = scale * (weight.unsqueeze(-1) if scale.dim() > weight.dim() else weight)
    v = v.to(device=device, dtype=torch.float64)
    scale = scale.to(device)
    return scale @ v.T if v.dim() == 2 else scale.unsqueeze(-1) * v


@dataclass(kw_only=True)
class ExpertLowRankAdd(LowRankAdd):
    """Adds ``w_e(x) · V (Uᵀ k_e(x))`` to an MoE block's output: what ``down_proj[e] + V Uᵀ`` changes there, ``x`` the
    block input captured by ``capture`` in the same forward pass, ``k_e(x)`` expert ``e``'s keys and ``w_e(x)`` its
    router weight (0 at the tokens not routed to it; :mod:`editors.layers.experts`).

    Attributes:
        capture: the :class:`KeyCapture` at the block's input node.
        layer: the expert.
        u: ``[d_in]`` or ``[d_in, r]``; v: ``[d_out]`` or ``[d_out, r]``.
    """

    layer: ExpertLayer

    def op(self, original: torch.Tensor) -> torch.Tensor:
        if not self.capture.keys:
            raise RuntimeError("the expert's patch at the block output ran before its capture at the block input")
        hidden = self.capture.keys.pop()  # [..., d_model]
        keys = self.layer.keys_of(hidden)  # [..., d_in]
        change = _low_rank_change(keys, self.u, self.v, original.device, weight=self.layer.routing_weight(hidden))
        return original + change.reshape(original.shape).to(original.dtype)


def layer_patches(layer: LinearLayer | ExpertLayer, u: torch.Tensor, v: torch.Tensor) -> dict[str, Any]:
    """The patch map adding what ``W + V Uᵀ`` changes at ``layer``'s output: :func:`low_rank_patches` for a linear
    layer, the block-output change of :class:`ExpertLowRankAdd` for one expert of an MoE block.

    Args:
        layer: the edited layer.
        u: ``[d_in]`` or ``[d_in, r]``; v: ``[d_out]`` or ``[d_out, r]`` (not detached: a value search differentiates
            through ``v``).
    """
    capture = KeyCapture()
    add = (ExpertLowRankAdd(capture=capture, layer=layer, u=u, v=v) if isinstance(layer, ExpertLayer)
           else LowRankAdd(capture=capture, u=u, v=v))
    return {layer.input_node: [capture], layer.output_node: [add]}


def low_rank_patches(input_node: str, output_node: str, u: torch.Tensor, v: torch.Tensor) -> dict[str, Any]:
    """The patch map ``{input_node: KeyCapture, output_node: LowRankAdd}`` adding ``v uᵀ k`` to the output.

    Args:
        input_node: NodePath of the layer input (keys ``[..., d_in]``).
        output_node: NodePath of the layer output (values ``[..., d_out]``).
        u: ``[d_in]`` or ``[d_in, r]``; v: ``[d_out]`` or ``[d_out, r]``.
    """
    capture = KeyCapture()
    return {input_node: [capture], output_node: [LowRankAdd(capture=capture, u=u.detach(), v=v.detach())]}


def updated_weight_patches(layer: LinearLayer, u: torch.Tensor, v: torch.Tensor) -> dict[str, Any]:
    """Patches under which the graph computes with ``layer``'s weight changed by ``V Uᵀ``, for passes that measure the
    model as an edit will leave it (MEMIT's later layers, arXiv 2210.07229 Algorithm 1).

    A writable weight gets a :class:`gradpatch.ReplacePatch` of its weight node holding exactly the tensor
    :meth:`editors.Edit.apply` would write (``W`` plus ``ΔW`` computed in float64 and cast to the weight's dtype): no
    cost per token (:func:`low_rank_patches` costs ``(d_in + d_out)·r`` float64 multiply-adds per token, more than the
    layer itself at MEMIT's rank of 1,000). A quantized or offloaded layer, and one expert of an MoE block (a slice of a
    fused weight), get :func:`layer_patches`.

    Args:
        layer: the edited layer.
        u: ``[d_in]`` or ``[d_in, r]``; v: ``[d_out]`` or ``[d_out, r]``.

    Returns:
        A patch map (NodePath -> list of patches).
    """
    if layer.not_writable() or isinstance(layer, ExpertLayer):
        return layer_patches(layer, u, v)
    weight = layer.weight.detach()
    return {f"{layer.path}.weight": [ReplacePatch(value=weight + layer.delta_weight(u, v))]}
