"""Reading node activations with the patch engine, stopping the forward pass once they were read.

The activations at nodes up to a depth only depend on the computation up to there: :func:`node_activations` holds
the nodes it is asked for (a layer's input node, several layers' inputs, a residual stream) with
:class:`~gradpatch.patches.HoldPatch` patches and raises once every one was reached, so the layers after the last
of them never run (the trick of ROME's ``nethook.Trace(stop=True)``). Editing (keys, statistics, value passes) and
dictionary training (activation streaming, widths, decoder-bias initialisation) read activations through it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from .patches import CustomPatch, HoldPatch, Patch

__all__ = ["node_activations"]


class _StopForward(Exception):
    """Raised inside the forward pass once every wanted activation is held."""


def node_activations(pg: nn.Module, nodes: Sequence[str], input_ids: torch.Tensor, stop: bool = True,
                     patches: Mapping[str, Patch | Sequence[Patch]] | None = None,
                     **kwargs: Any) -> list[torch.Tensor]:
    """The activations of several nodes in one forward pass without gradients (detached), stopping once all were
    read.

    Args:
        pg: the :class:`gradpatch.PatchableGraph` of the model.
        nodes: NodePaths of tensor nodes, e.g. ``["model.layers_2.mlp.down_proj.input", "model.layers_6.output"]``
            (a NodePath named twice is read once and returned twice).
        input_ids: ``[batch, seq]`` token ids (right-padded batches need no attention mask).
        stop: abort the forward pass once every node was reached (the later layers never run).
        patches: more patches for the pass (NodePath -> patch or list), e.g. an edit applied as patches; the
            reading patch runs after them, so it sees their effect.
        kwargs: more model arguments (``use_cache=False`` is added).

    Returns:
        One tensor per node, in the order of ``nodes`` (each as the pass saw it, e.g. ``[batch, seq, d]``).

    Raises:
        RuntimeError: a node was never reached (e.g. the layer is not used by this forward).
    """
    held = {node: HoldPatch() for node in nodes}

    def stop_when_all_held(value: Any) -> Any:
        if all(patch.held is not None for patch in held.values()):
            raise _StopForward
        return value

    mapping: dict[str, list[Patch]] = {}
    for node, patch in (patches or {}).items():
        mapping[node] = list(patch) if isinstance(patch, (list, tuple)) else [patch]
    for node, patch in held.items():
        mapping[node] = [*mapping.get(node, []), patch]
        if stop:
            mapping[node].append(CustomPatch(custom_op=stop_when_all_held, requires_clone=False))
    kwargs.setdefault("use_cache", False)
    with torch.no_grad():
        try:
            with pg.patch(mapping):
                pg(input_ids, **kwargs)
        except _StopForward:
            pass
    missing = [node for node, patch in held.items() if patch.held is None]
    if missing:
        raise RuntimeError(f"The forward pass never reached {missing}; are these nodes used by the model?")
    return [held[node].held.detach() for node in nodes]
