"""Node names: the names NodePaths use for graph nodes, opaque inputs and attributes."""

from __future__ import annotations

from torch import fx

from .._torch_compat import set_node_name
from .hierarchy import RESERVED_LEAF_NAMES, leaf_node_name


def unique_names(originals: list[str], reserved: set[str]) -> list[str]:
    """NodePath names for inputs and attributes named ``originals`` (in order), as graphpatch names them: dunders
    stripped (``__constants__`` -> ``constants``), duplicates numbered (``x``, ``x_1``), then names that NodePaths
    reserve prefixed (``_shape`` -> ``sub_shape``, numbered if taken)."""
    used = set(reserved)
    first = [_take(leaf_node_name(name, prefix_reserved=False), used) for name in originals]
    return [_take(leaf_node_name(name), used) if name in RESERVED_LEAF_NAMES else name for name in first]


def _take(candidate: str, used: set[str]) -> str:
    name, suffix = candidate, 1
    while name in used:
        name, suffix = f"{candidate}_{suffix}", suffix + 1
    used.add(name)
    return name


def assign_node_names(graph: fx.Graph, names: dict[fx.Node, str]) -> None:
    """Give each node in ``names`` its name; other nodes holding one of those names are renamed first (the call
    sites of submodules keep the names the model's attributes give them), and so is a value the model's code calls
    ``output`` (Gemma's norms): the leaf ``output`` is always the graph's return value."""
    wanted = set(names.values()) | {"output"}
    used = {node.name for node in graph.nodes} | wanted
    for node in graph.nodes:
        if node not in names and node.op != "output" and node.name in wanted:
            suffix = 1
            while f"{node.name}_{suffix}" in used:
                suffix += 1
            used.add(f"{node.name}_{suffix}")
            set_node_name(node, f"{node.name}_{suffix}")
    for node, name in names.items():
        set_node_name(node, name)
