"""Applying patches inside graphs: the patch table of a wrapper, and the patched variant of a graph's code (the
module was ``gradpatch.patching``, a name too close to :mod:`gradpatch.patches`, the patch kinds)."""

from __future__ import annotations

import copy
from typing import Any, Callable

from torch import fx

from ._torch_compat import forward_from_graph
from .patches import Patch

__all__ = ["LEAF_NAME", "PATCH_TABLE_ATTRIBUTE", "PatchTable", "apply_patches", "dig_key", "leaf_name", "patched_graph"]

#: node name -> [(dig keys, patch), ...] in application order.
PatchTable = dict[str, list[tuple[tuple[str, ...], Patch]]]

PATCH_TABLE_ATTRIBUTE = "_gp_patch_table"


def apply_patches(table: PatchTable, name: str, value: Any) -> Any:
    """Apply the patches registered for node ``name`` to ``value`` in order; returns the patched value."""
    for dig, patch in table[name]:
        value = _apply_at(value, dig, patch)
    return value


def _apply_at(value: Any, dig: tuple[str, ...], patch: Patch) -> Any:
    if not dig:
        return patch(value)
    key = dig_key(value, dig[0])
    replaced = _apply_at(value[key], dig[1:], patch)
    if isinstance(value, tuple):
        items = list(value)
        items[key] = replaced
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    if isinstance(value, list):
        items = list(value)
        items[key] = replaced
        return items
    new = copy.copy(value)
    new[key] = replaced
    return new


def dig_key(value: Any, part: str) -> Any:
    """The index into ``value`` that a NodePath dig part names (``sub_2`` for sequences, keys for mappings).

    Raises:
        KeyError: ``part`` does not name an item of ``value``.
    """
    if isinstance(value, (tuple, list)):
        if not part.startswith("sub_") or not part[4:].isdigit():
            raise KeyError(f"dig '{part}' into a {type(value).__name__}: use sub_0 .. sub_{len(value) - 1}")
        return int(part[4:])
    return part


#: ``node.meta`` key of a placeholder's NodePath name when it differs from its argument name.
LEAF_NAME = "gp_leaf"


def leaf_name(node: fx.Node) -> str:
    """Name of a graph node in NodePaths: placeholders by their argument name (``sub_shape`` for a reserved
    ``_shape``), the output as ``output``, the rest by node name."""
    if node.op == "placeholder":
        return node.meta.get(LEAF_NAME) or str(node.target).lstrip("*")
    if node.op == "output":
        return "output"
    return node.name


def patched_graph(graph: fx.Graph, names: frozenset[str]) -> Callable[..., Any]:
    """The forward function of ``graph`` with :func:`apply_patches` called after each node named in ``names``
    (NodePath leaf names: placeholders by argument name, ``"output"`` for the return value)."""
    patched = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    nodes = list(graph.nodes)
    placeholders = [node for node in nodes if node.op == "placeholder"]
    for node in placeholders:
        env[node] = patched.node_copy(node, env.__getitem__)
    table = patched.create_node("get_attr", PATCH_TABLE_ATTRIBUTE, name="_gp_patches")
    for node in placeholders:
        if leaf_name(node) in names:
            env[node] = patched.call_function(apply_patches, (table, leaf_name(node), env[node]))
    for node in nodes:
        if node.op == "placeholder":
            continue
        if node.op == "output":
            result = fx.map_arg(node.args[0], env.__getitem__)
            if "output" in names:
                result = patched.call_function(apply_patches, (table, "output", result))
            patched.output(result)
            continue
        env[node] = patched.node_copy(node, env.__getitem__)
        if node.name in names:
            env[node] = patched.call_function(apply_patches, (table, node.name, env[node]))
    return forward_from_graph(patched)
