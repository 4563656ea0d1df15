"""NodePaths and the navigable tree ``pg.graph``.

A NodePath is the dot-joined chain of node names from the root graph to a node
(``"model.layers_3.mlp.down_proj.output"``); ``|`` then dot-joined dig parts reach inside container values
(``"output|sub_0"``, ``"self_attn.output|sub_0"``, ``"output|logits"``).
"""

from __future__ import annotations

import difflib
import inspect
from typing import Any, Iterator

from torch import fx, nn

from .graph_modules import CompiledGraphModule, MultiplyInvokedModule, OpaqueGraphModule, leaf_name
from .tracer import check_shape_guard
from .values import ValueInfo


class NodeData:
    """One node of ``pg.graph``: a graph (a submodule), a leaf (a tensor operation, input, weight, output) or a dig
    into a leaf's container value.

    Attribute access walks to children (``pg.graph.model.layers_0``), with tab completion; ``repr(node)`` and
    ``print(node)`` draw the subtree with the shapes seen on the example inputs. A node can stand for its
    NodePath in ``pg.patch({...})``.

    Attributes:
        _path: the NodePath string.
        _shape: ``torch.Size`` of the example value for tensor leaves, else ``None``.
        _code: generated code of a graph, or the line of generated code that computes a leaf.
    """

    def __init__(self, path: str, name: str, *, module: nn.Module | None = None, owner: nn.Module | None = None,
                 key: str = "", dig: tuple[str, ...] = (), info: ValueInfo | None = None, code: str = "",
                 op: str = "") -> None:
        self._path = path
        self._name = name
        self._module = module
        self._owner = owner
        self._key = key
        self._dig = dig
        self._info = info
        self._code = code
        self._op = op
        self._children: dict[str, NodeData] = {}

    # --- navigation ----------------------------------------------------------------------------------------

    def __getattr__(self, name: str) -> "NodeData":
        if name.startswith("__") or name.startswith("_"):
            raise AttributeError(name)
        children = self.__dict__.get("_children", {})
        if name in children:
            return children[name]
        close = difflib.get_close_matches(name, list(children), n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else f"; children: {', '.join(list(children)[:20])}"
        raise AttributeError(f"'{self._path or '<root>'}' has no child '{name}'{hint}")

    def __dir__(self) -> list[str]:
        return list(self._children)

    def __iter__(self) -> Iterator["NodeData"]:
        return iter(self._children.values())

    @property
    def _is_graph(self) -> bool:
        return self._module is not None

    @property
    def _shape(self) -> Any:
        return None if self._info is None else self._info.shape

    # --- drawing -------------------------------------------------------------------------------------------

    def _label(self) -> str:
        if self._is_graph:
            kind = "Graph" if isinstance(self._module, CompiledGraphModule) else "OpaqueGraph"
            return f"{kind}({len(self._children)})"
        return self._info.label() if self._info is not None else "?"

    def _lines(self, prefix: str, depth: int | None) -> list[str]:
        lines: list[str] = []
        items = list(self._children.values())
        if depth is not None and depth <= 0:
            return lines
        for index, child in enumerate(items):
            last = index == len(items) - 1
            lines.append(f"{prefix}{'└─' if last else '├─'}{child._name}: {child._label()}")
            lines.extend(child._lines(prefix + ("  " if last else "│ "), None if depth is None else depth - 1))
        return lines

    def _tree(self, depth: int | None = None) -> str:
        """Draw the subtree down to ``depth`` levels (all levels by default)."""
        head = f"{self._name or '<root>'}: {self._label()}"
        return "\n".join([head, *self._lines("", depth)])

    def __repr__(self) -> str:
        return self._tree()


class NodeTree:
    """The whole tree of a PatchableGraph, with NodePath lookup."""

    def __init__(self, root_module: nn.Module) -> None:
        self.root = NodeData("", "", module=root_module, code=_module_code(root_module))
        self._fill_module(self.root, root_module)

    def find(self, path: str) -> NodeData:
        """The node at NodePath ``path``.

        Raises:
            KeyError: no such node; the message names the closest valid NodePaths.
        """
        node_part, _, dig_part = path.partition("|")
        current = self.root
        parts = [part for part in node_part.split(".") if part] if node_part else []
        parts += dig_part.split(".") if dig_part else []
        for part in parts:
            child = current._children.get(part)
            if child is None:
                close = difflib.get_close_matches(path, self.all_paths(), n=5, cutoff=0.6)
                hint = f" Closest valid NodePaths: {', '.join(close)}" if close else ""
                raise KeyError(f"NodePath '{path}' does not exist (no '{part}' under "
                               f"'{current._path or '<root>'}').{hint}")
            current = child
        return current

    def all_paths(self) -> list[str]:
        paths: list[str] = []

        def walk(node: NodeData) -> None:
            for child in node._children.values():
                paths.append(child._path)
                walk(child)

        walk(self.root)
        return paths

    # --- building ------------------------------------------------------------------------------------------

    def _fill_module(self, parent: NodeData, module: nn.Module) -> None:
        if isinstance(module, CompiledGraphModule):
            self._fill_compiled(parent, module)
        elif isinstance(module, OpaqueGraphModule):
            self._fill_opaque(parent, module)

    def _fill_compiled(self, parent: NodeData, module: CompiledGraphModule) -> None:
        inputs = set(getattr(module, "input_names", []))
        lines = _assignment_lines(module.code)
        for node in module.graph.nodes:
            name = leaf_name(node)
            if (node.op == "placeholder" and name not in inputs) or node.target is check_shape_guard:
                continue
            if node.op == "call_module":
                self._add_module(parent, node.name, module.get_submodule(str(node.target)))
                continue
            info: ValueInfo = node.meta.get("gp_info", ValueInfo("?"))
            code = lines.get(node.name, "") if node.op != "output" else lines.get("return", "")
            self._add_leaf(parent, name, module, name, info, code or node.format_node(), _operation(node))

    def _fill_opaque(self, parent: NodeData, module: OpaqueGraphModule) -> None:
        infos: dict[str, ValueInfo] = getattr(module, "infos", {})
        for name, info in infos.items():
            if name == "output":
                continue
            self._add_leaf(parent, name, module, name, info, f"{name}  # opaque module input / parameter", name)
        for child_name, child in module.named_children():
            if isinstance(child, MultiplyInvokedModule):
                for index, invocation in enumerate(child.children()):
                    self._add_module(parent, f"{child_name}_{index}", invocation)
            else:
                self._add_module(parent, child_name, child)
        if "output" in infos:
            self._add_leaf(parent, "output", module, "output", infos["output"], "return  # opaque module output",
                           "output")

    def _add_module(self, parent: NodeData, name: str, module: nn.Module) -> None:
        node = NodeData(_join(parent._path, name), name, module=module, code=_module_code(module))
        parent._children[name] = node
        self._fill_module(node, module)

    def _add_leaf(self, parent: NodeData, name: str, owner: nn.Module, key: str, info: ValueInfo, code: str,
                  op: str) -> None:
        leaf = NodeData(_join(parent._path, name), name, owner=owner, key=key, info=info, code=code, op=op)
        parent._children[name] = leaf
        _add_digs(leaf, info, ())


def _add_digs(node: NodeData, info: ValueInfo, dig: tuple[str, ...]) -> None:
    for part, item in info.items.items():
        path = f"{node._path}{'.' if dig else '|'}{part}"
        child = NodeData(path, part, owner=node._owner, key=node._key, dig=dig + (part,), info=item,
                         code=node._code, op=f"{node._op}|{part}")
        node._children[part] = child
        _add_digs(child, item, dig + (part,))


def _operation(node: fx.Node) -> str:
    """What a node computes, independent of its numbering: ``call_method:view``, ``placeholder:input``."""
    target = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", repr(node.target))
    return f"{node.op}:{target}"


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _module_code(module: nn.Module) -> str:
    if isinstance(module, CompiledGraphModule):
        return module.code
    original = getattr(module, "_gp_original", None)
    if original is not None:
        try:
            return inspect.getsource(type(original).forward)
        except (OSError, TypeError):
            return f"<source of {type(original).__name__}.forward unavailable>"
    return ""


def _assignment_lines(code: str) -> dict[str, str]:
    """Map each assigned name in generated code to its line (``'mul_3' -> 'mul_3 = torch.mul(...)'``)."""
    lines: dict[str, str] = {}
    for line in code.splitlines():
        stripped = line.strip()
        if stripped.startswith("return"):
            lines["return"] = stripped
            continue
        target, sep, _ = stripped.partition(" = ")
        if sep and target.isidentifier():
            lines[target] = stripped.split(";")[0]
    return lines
