"""Which kind of edited layer a NodePath names: one expert of a fused MoE weight or a linear layer."""

from __future__ import annotations

from torch import nn

from .experts import ExpertLayer, resolve_expert_layer
from .linear import LinearLayer, resolve_linear

__all__ = ["resolve_layer"]


def resolve_layer(target: nn.Module, node_path: str) -> LinearLayer | ExpertLayer:
    """The edited layer at ``node_path``: one expert of a fused MoE experts weight
    (``"model.layers_3.mlp.experts.down_proj[2]"``; without ``[e]``, the fused weight, whose expert an editor chooses
    per fact) or a linear layer (:func:`~editors.layers.linear.resolve_linear`).

    Args:
        target: a :class:`gradpatch.PatchableGraph` (or a plain model, for applying saved edits).
        node_path: NodePath of the layer module (a trailing ``.weight`` is accepted and dropped) or of one expert.

    Raises:
        KeyError: unknown NodePath.
        LayerKindError: the module is not ``nn.Linear`` or a ``Conv1D``, a fused experts weight of another layout, or
            an expert index out of range.
    """
    expert = resolve_expert_layer(target, node_path)
    return expert if expert is not None else resolve_linear(target, node_path)
