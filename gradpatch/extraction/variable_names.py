"""Node names from the model's code: an operation is named after the local variable its result is first stored in.

``query_states = self.q_proj(x).view(shape).transpose(1, 2)`` makes the ``transpose`` node ``query_states``;
``y += x`` makes the new node ``y_1``; values never stored keep torch.fx's names (``add``, ``mul_3``). This is how
torch.compile (and so graphpatch) names nodes, and it gives NodePaths that read like the code
(``model.layers_0.self_attn.k_embed``, ``...value_states``) and stay the same in graphs traced for other input
sizes, since they come from the code rather than from a count of earlier operations.

The tracer calls :meth:`VariableNamer.scan` before creating each node and once after the traced call returns; a scan
reads the locals of the model's frames on the stack (the traced forward and the helper functions it called, not
torch's or gradpatch's own) and names the nodes created while each frame ran.
"""

from __future__ import annotations

import builtins
import keyword
import sys
from pathlib import Path
from types import CodeType, FrameType

import torch
from torch import fx

from .._torch_compat import set_node_name

#: Frames of these packages are library code, not the model's: their locals never name nodes.
LIBRARY_DIRS = tuple(str(Path(module.__file__).resolve().parent) for module in (torch, sys.modules[__package__]))
_RESERVED = frozenset(dir(builtins)) | frozenset(keyword.kwlist) | {"self"}


class VariableNamer:
    """Renames the nodes of one graph after the variables of the traced code (see the module docstring).

    Args:
        graph: the graph being traced.
        stop: the code object of the tracer's entry function; frames above it belong to other tracers.
    """

    def __init__(self, graph: fx.Graph, stop: CodeType) -> None:
        self._graph = graph
        self._stop = stop
        self._frames: dict[FrameType, int] = {}  # frame -> number of nodes that existed when it was first seen
        self._named: set[fx.Node] = set()
        self._order: dict[fx.Node, int] = {}
        self._used = {node.name for node in graph.nodes}

    def created(self, node: fx.Node) -> None:
        """Record a node the tracer just created."""
        self._order[node] = len(self._order)
        self._used.add(node.name)

    def scan(self) -> None:
        """Name unnamed nodes after the variables holding them: first in the model's frames that returned since
        the last scan (their final locals, as a value is stored there before its caller stores it), then in those
        on the stack, innermost first."""
        live: list[FrameType] = []
        frame = sys._getframe(1)
        while frame is not None and frame.f_code is not self._stop:
            if not frame.f_code.co_filename.startswith(LIBRARY_DIRS):
                live.append(frame)
            frame = frame.f_back
        for finished in [seen for seen in self._frames if seen not in live]:
            self._read(finished)
            del self._frames[finished]
        for frame in live:
            self._frames.setdefault(frame, len(self._order))
            self._read(frame)

    def finish(self) -> None:
        """Read the final locals of every frame still held (innermost first), then let them go."""
        for frame in reversed(list(self._frames)):
            self._read(frame)
        self._frames.clear()

    def _read(self, frame: FrameType) -> None:
        first = self._frames[frame]
        for variable, value in frame.f_locals.items():
            # vars(): an attribute proxy (``x.shape`` not yet used) creates its node lazily when asked for it
            node = vars(value).get("node") if isinstance(value, fx.Proxy) else None
            if (not isinstance(node, fx.Node) or node.graph is not self._graph or node in self._named
                    or node.op not in ("call_function", "call_method", "call_module")
                    or self._order.get(node, -1) < first or variable in _RESERVED or variable.startswith("_")):
                continue
            self._named.add(node)
            name = self._take(variable)
            if node.op != "call_module":  # a submodule call keeps its call-site name, but uses up the variable's
                set_node_name(node, name)

    def _take(self, name: str) -> str:
        candidate, suffix = name, 1
        while candidate in self._used:
            candidate, suffix = f"{name}_{suffix}", suffix + 1
        self._used.add(candidate)
        return candidate

