"""Shape guards: the run-time checks that a graph's size decisions still hold for a call's sizes."""

from __future__ import annotations

import sys
from types import FrameType
from typing import Any

from ..errors import ShapeSpecializationError

__all__ = ["check_shape_guard"]


def check_shape_guard(value: Any, expected: Any, name: str) -> None:
    """Raise :class:`ShapeSpecializationError` when a size-dependent Python decision differs from the example's.

    A decision recorded as a bool is checked as a truth test (``if value`` / ``if not value``), not by comparing
    bools: under ``torch.compile`` with dynamic shapes ``value`` is a symbolic bool, which can be tested for truth
    (a guard on the sizes) but not compared with ``True`` or ``False``.

    Args:
        value: the decided node's value on this call.
        expected: its value on the example.
        name: the decided node's name (the message adds the NodePath of the graph running the check).

    Raises:
        ShapeSpecializationError: the graph does not hold for this call's shapes.
    """
    if isinstance(expected, bool):
        holds = bool(value) if expected else not value
    else:
        holds = bool(value == expected)
    if not holds:
        raise ShapeSpecializationError(
            f"the model's code decides on {name} in '{_calling_graph(sys._getframe(1))}' from input sizes; the "
            f"graph was extracted where it was "
            f"{expected!r} and this call gives {value!r}, within the same class of sizes (each dimension 1 or "
            f"larger). Build the PatchableGraph with example inputs shaped like this call"
        )


def _calling_graph(frame: FrameType | None) -> str:
    """The NodePath of the graph whose generated code (``self`` its wrapper) is at or just above ``frame``."""
    for _ in range(3):
        if frame is None:
            break
        path = getattr(frame.f_locals.get("self"), "_gp_graph_path", None)
        if isinstance(path, str):
            return path or "<root>"
        frame = frame.f_back
    return "<unknown module>"
