"""Reading a layer's input (the keys) with the patch engine, stopping the forward pass early.

The keys of layer ``L`` only depend on the computation up to ``L``; :func:`node_activations` records the nodes it
is asked for (the layer's input node, several layers' inputs, a residual stream) with :class:`gradpatch.CustomPatch`
patches and raises once all were seen, so the layers after the last of them never run (the trick of ROME's
``nethook.Trace(stop=True)``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from gradpatch import CustomPatch

from ..layers import LinearLayer

__all__ = ["layer_inputs", "node_activations"]


class _StopForward(Exception):
    """Raised inside the forward pass once the wanted activation is recorded."""


def node_activations(pg: nn.Module, nodes: Sequence[str], input_ids: torch.Tensor, stop: bool = True,
                     patches: Mapping[str, Any] | None = None, **kwargs: Any) -> list[torch.Tensor]:
    """The activations of several nodes in one forward pass (detached), stopping once all were recorded.

    Args:
        pg: the :class:`gradpatch.PatchableGraph` of the model.
        nodes: NodePaths of tensor nodes, e.g. ``["model.layers_2.mlp.down_proj.input", "model.layers_6.output"]``.
        input_ids: ``[batch, seq]`` token ids (right-padded batches need no attention mask).
        stop: abort the forward pass once every node was recorded (the later layers never run).
        patches: more patches for the pass (NodePath -> patch or list), e.g. an edit applied as patches; the
            recording patch runs after them, so it sees their effect.
        kwargs: more model arguments (``use_cache=False`` is added).

    Returns:
        One tensor per node, in the order of ``nodes`` (each as first seen in the pass, e.g. ``[batch, seq, d]``).

    Raises:
        RuntimeError: a node was never reached (e.g. the layer is not used by this forward).
    """
    seen: dict[str, torch.Tensor] = {}
    wanted = list(dict.fromkeys(nodes))

    def recorder(node: str) -> CustomPatch:
        def grab(activation: torch.Tensor) -> torch.Tensor:
            seen.setdefault(node, activation.detach())
            if stop and len(seen) == len(wanted):
                raise _StopForward
            return activation

        return CustomPatch(custom_op=grab)

    mapping: dict[str, Any] = {}
    for node, patch in (patches or {}).items():
        mapping[node] = list(patch) if isinstance(patch, (list, tuple)) else [patch]
    for node in wanted:
        mapping[node] = [*mapping.get(node, []), recorder(node)]
    kwargs.setdefault("use_cache", False)
    with torch.no_grad():
        try:
            with pg.patch(mapping):
                pg(input_ids, **kwargs)
        except _StopForward:
            pass
    missing = [node for node in wanted if node not in seen]
    if missing:
        raise RuntimeError(f"The forward pass never reached {missing}; are these nodes used by the model?")
    return [seen[node] for node in nodes]


def layer_inputs(pg: nn.Module, layer: LinearLayer, input_ids: torch.Tensor, stop: bool = True, **kwargs: Any) -> torch.Tensor:
    """The edited layer's input for a batch, ``[batch, seq, d_in]`` (detached): :func:`node_activations` of its
    input node.

    Args:
        pg: the :class:`gradpatch.PatchableGraph` of the model.
        layer: the layer whose input node is read.
        input_ids: ``[batch, seq]`` token ids (right-padded batches need no attention mask).
        stop: abort the forward pass right after the layer input is recorded (saves the later layers).
        kwargs: more model arguments (``use_cache=False`` is added).

    Returns:
        ``[batch, seq, d_in]`` tensor.

    Raises:
        RuntimeError: the input node was never reached (e.g. the layer is not used by this forward).
    """
    return node_activations(pg, [layer.input_node], input_ids, stop=stop, **kwargs)[0]
