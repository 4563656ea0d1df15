"""Whether every transcoder sits on a path from the token embeddings to the logits, read from the graph's data flow.

An attribution graph's edges run from the embeddings through the transcoders' features to the logits; a transcoder
whose input node does not depend on the embeddings (e.g. the rotary ``cos``/``sin`` tables, computed from the
positions alone), or whose output node the logits do not depend on (a value the model computes and never uses),
would give features with no inputs or no effect. The dependencies are read from the graph itself, as autograd sees
them in one forward pass of the prompt: a zero scalar δ_E is added to the embeddings and a zero scalar δ_ℓ to each
output node (values unchanged); a node x depends on the embeddings iff δ_E is a leaf of x's autograd graph, and the
logits depend on an output node iff δ_ℓ is a leaf of theirs. The autograd graphs are walked, not differentiated:
the answer is structural (whether a path exists), not a test of a numerically zero gradient, and costs no backward
pass.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from ..patchable_graph import PatchableGraph
from ..patches import CustomPatch, HoldPatch, Patch
from .errors import NoPathError

__all__ = ["check_paths"]


def _leaves(value: Any) -> set[int]:
    """The ``id`` of every leaf tensor that requires grad in the autograd graph of ``value`` (empty for a value that
    is not a tensor or has no history)."""
    if not isinstance(value, torch.Tensor) or not value.requires_grad:
        return set()
    if value.grad_fn is None:
        return {id(value)}
    found: set[int] = set()
    seen: set[Any] = set()
    stack = [value.grad_fn]
    while stack:
        function = stack.pop()
        if function is None or function in seen:
            continue
        seen.add(function)
        variable = getattr(function, "variable", None)  # an AccumulateGrad node holds its leaf
        if isinstance(variable, torch.Tensor):
            found.add(id(variable))
        stack.extend(next_function for next_function, _ in function.next_functions)
    return found


def check_paths(pg: PatchableGraph, nodes: Mapping[int, tuple[str, str]], ids: torch.Tensor, embed: str,
                forward_kwargs: Mapping[str, Any] | None = None) -> None:
    """Raise unless each layer's (input node, output node) lies on a path from ``embed`` to the logits.

    Args:
        pg: the graph.
        nodes: layer -> (NodePath read, NodePath written) of its transcoder.
        ids: the prompt ``[1, seq]``.
        embed: the NodePath of the token embeddings ``[1, seq, d_model]``.
        forward_kwargs: more keyword arguments of the forward pass.

    Raises:
        NoPathError: an input node that does not depend on the embeddings, or an output node on which the logits do
            not depend (the first found, in layer order; the message names the node and the fix).
    """
    device = ids.device
    embed_delta = torch.zeros((), device=device, requires_grad=True)
    output_deltas = {layer: torch.zeros((), device=device, requires_grad=True) for layer in nodes}
    held = {layer: HoldPatch() for layer in nodes}

    def add(delta: torch.Tensor) -> Callable[[Any], Any]:
        return lambda value: value + delta.to(value.dtype) if isinstance(value, torch.Tensor) else value

    patch_map: dict[str, list[Patch]] = {embed: [CustomPatch(custom_op=add(embed_delta), requires_clone=False)]}
    for layer, (read, _) in sorted(nodes.items()):
        patch_map.setdefault(read, []).append(held[layer])
    for layer, (_, write) in sorted(nodes.items()):
        patch_map.setdefault(write, []).append(CustomPatch(custom_op=add(output_deltas[layer]),
                                                           requires_clone=False))
    with torch.enable_grad(), pg.patch(patch_map):
        logits = pg(ids, **dict(forward_kwargs or {})).logits
    for layer, (read, _) in sorted(nodes.items()):
        if id(embed_delta) not in _leaves(held[layer].held):
            raise NoPathError(f"layer {layer}: the transcoder's input node '{read}' does not depend on the token "
                              f"embeddings '{embed}', so its features have no path from the prompt; give the NodePath "
                              f"of the MLP's input (print pg.graph to find it)")
    reached = _leaves(logits)
    for layer, (_, write) in sorted(nodes.items()):
        if id(output_deltas[layer]) not in reached:
            raise NoPathError(f"layer {layer}: the transcoder's output node '{write}' lies on no path to the logits "
                              f"(the logits do not depend on it), so its features have no effect; give the NodePath "
                              f"of the MLP's output that the residual stream adds")
