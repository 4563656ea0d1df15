"""Reading a layer's input (the keys) with the patch engine, stopping the forward pass early.

The keys of layer ``L`` only depend on the computation up to ``L``; :func:`layer_inputs` records the layer's
input node with a :class:`gradpatch.CustomPatch` that then raises, so the layers after ``L`` never run
(the trick of ROME's ``nethook.Trace(stop=True)``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from gradpatch import CustomPatch

from .layers import LinearLayer

__all__ = ["layer_inputs"]


class _StopForward(Exception):
    """Raised inside the forward pass once the wanted activation is recorded."""


def layer_inputs(pg: nn.Module, layer: LinearLayer, input_ids: torch.Tensor, stop: bool = True, **kwargs: Any) -> torch.Tensor:
    """The edited layer's input for a batch, ``[batch, seq, d_in]`` (detached).

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
    seen: list[torch.Tensor] = []

    def grab(activation: torch.Tensor) -> torch.Tensor:
        seen.append(activation.detach())
        if stop:
            raise _StopForward
        return activation

    kwargs.setdefault("use_cache", False)
    with torch.no_grad():
        try:
            with pg.patch({layer.input_node: CustomPatch(custom_op=grab)}):
                pg(input_ids, **kwargs)
        except _StopForward:
            pass
    if not seen:
        raise RuntimeError(f"The forward pass never reached {layer.input_node}; is the layer used by the model?")
    return seen[0]
