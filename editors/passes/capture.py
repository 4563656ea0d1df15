"""Reading a layer's input (the keys) with the patch engine, stopping the forward pass early.

The keys of layer ``L`` only depend on the computation up to ``L``: :func:`layer_inputs` reads the edited layer's
input node with :func:`gradpatch.capture.node_activations` (re-exported here), which stops the forward pass once the
nodes asked for were reached.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from gradpatch.capture import node_activations

from ..layers import LinearLayer

__all__ = ["layer_inputs", "node_activations"]


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
