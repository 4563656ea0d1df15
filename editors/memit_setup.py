"""What MEMIT (arXiv 2210.07229) checks and derives before computing a batch: the requests (:func:`check_requests`),
the edited layers in forward order (:func:`forward_order`), the residual stream after the last one
(:func:`residual_node_of`), that the family adds the layers' outputs to it unchanged (:func:`check_adds_to_residual`),
and how an MoE expert's layer takes its share of the residual (:func:`layer_residuals`).
"""

from __future__ import annotations

from collections.abc import Sequence
import re
from typing import Any

import torch
from torch import nn

from gradpatch import CustomPatch, PatchableGraph
from gradpatch.errors import LayoutError
from gradpatch.layouts import ModelLayout, count_layers, detect_layout
from gradpatch.model_io import model_device

from .errors import ConflictingRequestsError, LayerKindError
from .layers import ExpertLayer, expert_path
from .layers import LinearLayer
from .requests import EditRequest

__all__ = ["MIN_ROUTER_WEIGHT", "check_adds_to_residual", "check_requests", "check_experts", "forward_order",
           "layer_residuals", "residual_node_of"]

#: A fact whose subject reaches an edited expert with a smaller mean router weight asks that expert for no change.
MIN_ROUTER_WEIGHT = 0.05


def check_requests(requests: Sequence[EditRequest]) -> list[EditRequest]:
    """The requests of one batch, checked: at least one, and no subject asked for two different targets.

    Raises:
        ValueError: no request.
        ConflictingRequestsError: two requests give one subject different ``target_new`` (both are named).
    """
    requests = list(requests)
    if not requests:
        raise ValueError("No request to edit: give at least one EditRequest")
    first: dict[str, int] = {}
    for i, request in enumerate(requests):
        j = first.setdefault(request.subject, i)
        if requests[j].target_new != request.target_new:
            raise ConflictingRequestsError(
                f"Requests {j} and {i} give subject {request.subject!r} two targets ({requests[j].target_new!r} and "
                f"{request.target_new!r}); keep one of them in this batch (edit the other in a later batch)")
    return requests


def forward_order(pg: nn.Module, tokenizer: Any, layers: Sequence[LinearLayer]) -> list[LinearLayer]:
    """``layers`` sorted in the order a forward pass reaches their inputs (one pass on a short text)."""
    seen: list[str] = []

    def note(node: str) -> CustomPatch:
        return CustomPatch(custom_op=lambda x: seen.append(node) or x)

    ids = torch.tensor([list(tokenizer("The capital of France is")["input_ids"])] * 2, device=model_device(pg))
    with torch.no_grad(), pg.patch({layer.input_node: note(layer.input_node) for layer in layers}):
        pg(ids, use_cache=False)
    order = {node: i for i, node in reversed(list(enumerate(seen)))}
    return sorted(layers, key=lambda layer: order.get(layer.input_node, len(order)))


def residual_node_of(layer: LinearLayer | ExpertLayer, pg: PatchableGraph | None = None) -> str:
    """The residual stream after the block holding ``layer``: the model layout's ``hidden`` of that block where ``pg``'s
    family is in the layout table (:func:`gradpatch.layouts.detect_layout`; Falcon's ``transformer.h_5.output|sub_0``),
    else the ``.output`` of the nearest enclosing module whose name is a numbered element of a list
    (``model.layers_6`` for ``model.layers_6.mlp.down_proj``, ``transformer.h_5`` for ``transformer.h_5.mlp.c_proj``).

    Raises:
        LayerKindError: no enclosing module has such a name (pass ``residual_node=`` explicitly).
    """
    layout = _known_layout(pg)
    if layout is not None and pg is not None:
        for index in range(count_layers(pg, layout)):
            if layer.path.startswith(layout.block(index) + "."):
                return layout.path("hidden", index)
    parts = layer.path.split(".")
    for end in range(len(parts) - 1, 0, -1):
        if re.fullmatch(r".+_\d+", parts[end - 1]):
            return ".".join(parts[:end]) + ".output"
    raise LayerKindError(f"Cannot tell which block {layer.path!r} belongs to; pass residual_node=, the NodePath of "
                         f"the residual stream after it (e.g. 'model.layers_6.output')")


def check_adds_to_residual(pg: PatchableGraph) -> None:
    """Refuse a family whose blocks do not add the attention's and the MLP's outputs to the residual stream as they
    are (post-norms in Gemma 2/3 and OLMo 2, Granite's residual multiplier): MEMIT spreads each fact's residual over the
    edited layers' outputs as if each change reached the residual stream unchanged (Meng et al. 2023, eq. 14-16).

    Raises:
        LayerKindError: ``pg``'s layout has post-norms or scales what a block adds (the message names the family and
            says to use ROME, whose value search runs through the model).
    """
    layout = _known_layout(pg)
    if layout is not None and not layout.adds_outputs_unchanged:
        raise LayerKindError(f"MEMIT assumes each edited layer's output change reaches the residual stream unchanged; "
                             f"the {layout.family!r} layout puts a norm or a multiplier between them (it adds "
                             f"{layout.mlp!r}): use ROME, whose value search runs through the model, for this family")


def _known_layout(pg: PatchableGraph | None) -> ModelLayout | None:
    """``pg``'s family in the layout table, or ``None`` (no graph, or a model of another family)."""
    if pg is None:
        return None
    try:
        return detect_layout(pg)
    except LayoutError:
        return None


def check_experts(layers: Sequence[LinearLayer | ExpertLayer]) -> None:
    """Refuse a fused experts weight without an expert index: a MEMIT update is one solve per layer, so each layer's
    expert is named (``...experts.down_proj[e]``).

    Raises:
        LayerKindError: a layer is a fused experts weight with no expert chosen (the message names the fix).
    """
    for layer in layers:
        if isinstance(layer, ExpertLayer) and layer.expert is None:
            raise LayerKindError(
                f"{layer.path} is a fused weight of {layer.n_experts} experts; MEMIT writes each layer's update into "
                f"one expert: name it, e.g. '{expert_path(layer.fused_path, 0)}' (editors.layers.top_expert "
                f"gives the one a subject routes to most strongly), or use ROME, which picks each fact's expert")


def layer_residuals(layer: LinearLayer | ExpertLayer, hidden: torch.Tensor, residuals: torch.Tensor) -> torch.Tensor:
    """What ``W k_i`` must gain at ``layer`` for fact ``i``'s output to gain ``residuals[i]`` ``[F, d_out]``.

    A linear layer: the residuals. One expert of an MoE block changes the block output by ``w_e ΔW k`` (its router
    weight ``w_e``, :mod:`editors.layers.experts`), so fact ``i`` asks ``residuals[i] / w̄_i``, ``w̄_i`` its mean router
    weight over the key prompts (``hidden`` ``[F, P, d_model]``, the block inputs at the subject's last token); a fact routed
    there with ``w̄_i <`` :data:`MIN_ROUTER_WEIGHT` asks for no change (its key keeps its value; the later layers take
    its residual).
    """
    if not isinstance(layer, ExpertLayer):
        return residuals
    with torch.no_grad():
        weight = layer.routing_weight(hidden).mean(dim=1).to(device=residuals.device, dtype=residuals.dtype)  # [F]
    share = torch.where(weight >= MIN_ROUTER_WEIGHT, 1 / weight.clamp_min(MIN_ROUTER_WEIGHT), 0.0)
    return residuals * share.unsqueeze(1)
