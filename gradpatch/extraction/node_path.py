"""NodePaths and the navigable tree ``pg.graph``.

A NodePath is the dot-joined chain of node names from the root graph to a node
(``"model.layers_3.mlp.down_proj.output"``); ``|`` then dot-joined dig parts reach inside container values
(``"output|sub_0"``, ``"self_attn.output|sub_0"``, ``"output|logits"``).
"""

from __future__ import annotations

import difflib
import inspect
from typing import Any, Iterator

import torch
from torch import fx, nn

from ..errors import NodePathError
from .graph_code import graph_code
from .graph_modules import CompiledGraphModule, MultiplyInvokedModule, OpaqueGraphModule, UnusedModule
from .hierarchy import is_container, node_name
from ..patch_table import leaf_name
from .guards import check_shape_guard
from .tracer import OutputRebuilder
from ..value_info import ValueInfo

#: The attributes every node has besides its children (graphpatch's names).
RESERVED = ("_code", "_path", "_shape")


class NodeData:
    """One node of ``pg.graph``: a graph (a submodule), a leaf (a tensor operation, input, weight, output) or a dig
    into a leaf's container value.

    Attribute access walks to children (``pg.graph.model.layers_0``), with tab completion; ``node["a.b|sub_0"]``
    looks a NodePath up below this node; ``repr(node)`` draws the subtree with the shapes seen on the example
    inputs. A node can stand for its NodePath in ``pg.patch({...})``.

    Attributes:
        _path: the NodePath string.
        _shape: ``torch.Size`` of the example value for tensor leaves; for graphs and containers, a tree of the
            shapes below (``pg.graph._shape.output.sub_0``); ``None`` for other values.
        _code: generated code of a graph under its forward's own signature (:mod:`gradpatch.extraction.graph_code`),
            or the line of generated code that computes a leaf.
    """

    def __init__(self, path: str, name: str, *, module: nn.Module | None = None, owner: nn.Module | None = None,
                 key: str = "", dig: tuple[str, ...] = (), info: ValueInfo | None = None, code: str = "",
                 op: str = "", constant: bool = False, read_only: str = "") -> None:
        self._path = path
        self._code = code
        self._gp_name = name
        self._gp_module = module
        self._gp_owner = owner
        self._gp_key = key
        self._gp_dig = dig
        self._gp_info = info
        self._gp_op = op
        self._gp_constant = constant
        self._gp_read_only = read_only
        self._gp_children: dict[str, NodeData] = {}

    # --- navigation ----------------------------------------------------------------------------------------

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name.startswith("_gp_"):
            raise AttributeError(name)
        children = self.__dict__.get("_gp_children", {})
        if name in children:
            return children[name]
        close = difflib.get_close_matches(name, list(children), n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else f"; children: {', '.join(list(children)[:20])}"
        raise AttributeError(f"'{self._path or '<root>'}' has no child '{name}'{hint}")

    def __getitem__(self, path: str) -> "NodeData":
        """The node at NodePath ``path`` relative to this one (``pg.graph["model.layers_0.mlp"]``).

        Raises:
            NodePathError: no such node (a KeyError; the message names the closest valid NodePaths).
        """
        return _find(self, path)

    def __contains__(self, name: str) -> bool:
        return name in self._gp_children

    def __dir__(self) -> list[str]:
        return [*self._gp_children, "_code", "_shape"]

    def __iter__(self) -> Iterator["NodeData"]:
        return iter(self._gp_children.values())

    @property
    def _is_graph(self) -> bool:
        return self._gp_module is not None

    @property
    def is_graph(self) -> bool:
        """Whether this node is a graph (a submodule's), not a value: patch one of its nodes, e.g. ``output``."""
        return self._gp_module is not None

    @property
    def name(self) -> str:
        """The node's own name: the last component of its NodePath (``"down_proj"``, ``"sub_0"``; ``""`` at the
        root)."""
        return self._gp_name

    @property
    def code(self) -> str:
        """What ``_code`` shows: a graph's generated code under its forward's own signature
        (:mod:`gradpatch.extraction.graph_code`), or the line of generated code that computes a leaf."""
        return self._code

    @property
    def op_name(self) -> str:
        """The operation that computes this leaf as extraction names it (``"call_function:softmax"``,
        ``"placeholder:…"``, ``"input:x"`` in an opaque module); a dig's is its leaf's with ``"|part"``; ``""`` for
        graphs."""
        return self._gp_op

    @property
    def graph_module(self) -> nn.Module | None:
        """The graph module whose code computes this leaf (its torch.fx graph holds :attr:`fx_node`; its
        ``get_attr`` targets are its own attributes); ``None`` for graphs."""
        return self._gp_owner

    @property
    def fx_name(self) -> str:
        """The name of the torch.fx node that computes this leaf in :attr:`graph_module`'s graph (a dig's is its
        leaf's); ``""`` for graphs."""
        return self._gp_key

    @property
    def fx_node(self) -> fx.Node:
        """The torch.fx node that computes this leaf (a dig's is its leaf's), in :attr:`graph_module`'s graph.

        Raises:
            NodePathError: this node is a graph, or a leaf of an opaque module (no torch.fx graph).
        """
        graph = getattr(self._gp_owner, "graph", None)
        found = next((n for n in graph.nodes if n.name == self._gp_key), None) if graph is not None else None
        if found is None:
            raise NodePathError(f"'{self._path}' is not computed by a torch.fx node (a graph, or a value of an opaque "
                                f"module); take a leaf of a compiled graph")
        return found

    @property
    def tensor_shape(self) -> torch.Size | None:
        """The example value's shape when this node holds a tensor (``[batch, seq, d_model]`` for a layer output);
        ``None`` for graphs, containers and values that are not tensors."""
        info = self._gp_info
        return info.shape if info is not None and isinstance(info.shape, torch.Size) else None

    @property
    def _shape(self) -> Any:
        info = self._gp_info
        if info is not None and info.shape is not None:
            return info.shape
        if not self._gp_children:
            return None
        return ShapeTree(self._gp_name, {name: child._shape for name, child in self._gp_children.items()})

    # --- drawing -------------------------------------------------------------------------------------------

    def _label(self) -> str:
        if self._gp_module is not None:
            return "CompiledGraphModule" if isinstance(self._gp_module, CompiledGraphModule) else "OpaqueGraphModule"
        return self._gp_info.label() if self._gp_info is not None else ""

    def _tree(self, depth: int | None = None) -> str:
        """Draw the subtree down to ``depth`` levels (all levels by default)."""
        return draw(self._gp_name or "<root>", self._label(),
                    [(child._gp_name, child) for child in self._gp_children.values()],
                    lambda child: (child._label(), [(c._gp_name, c) for c in child._gp_children.values()]), depth)

    def __repr__(self) -> str:
        return self._tree()


class ShapeTree:
    """The shapes below a graph or container node: attribute access walks to children, ``repr`` draws them."""

    def __init__(self, name: str, children: dict[str, Any]) -> None:
        self._gp_name = name
        self._gp_children = children

    def __getattr__(self, name: str) -> Any:
        children = self.__dict__.get("_gp_children", {})
        if name in children:
            return children[name]
        raise AttributeError(f"no shape '{name}' here; children: {', '.join(list(children)[:20])}")

    def __dir__(self) -> list[str]:
        return list(self._gp_children)

    def __repr__(self) -> str:
        def expand(value: Any) -> tuple[str, list[tuple[str, Any]]]:
            if isinstance(value, ShapeTree):
                return "", list(value._gp_children.items())
            return "" if value is None else f"Size({', '.join(str(size) for size in value)})", []

        return draw(self._gp_name or "<root>", "", list(self._gp_children.items()), expand, None)


def draw(name: str, label: str, children: list[tuple[str, Any]], expand: Any, depth: int | None) -> str:
    """A tree drawing: ``name: label`` then one line per descendant (``├─child: label``); ``expand(child)`` gives
    a child's label and children."""
    lines = [f"{name}: {label}" if label else name]

    def walk(items: list[tuple[str, Any]], prefix: str, depth: int | None) -> None:
        if depth is not None and depth <= 0:
            return
        for index, (child_name, child) in enumerate(items):
            last = index == len(items) - 1
            child_label, grandchildren = expand(child)
            lines.append(f"{prefix}{'└─' if last else '├─'}{child_name}{': ' + child_label if child_label else ''}")
            walk(grandchildren, prefix + ("  " if last else "│ "), None if depth is None else depth - 1)

    walk(children, "", depth)
    return "\n".join(lines)


class NodeTree:
    """The whole tree of a PatchableGraph, with NodePath lookup."""

    def __init__(self, root_module: nn.Module) -> None:
        self.root = NodeData("", "", module=root_module, code=_module_code(root_module))
        self._fill_module(self.root, root_module)

    def find(self, path: str) -> NodeData:
        """The node at NodePath ``path``.

        Raises:
            NodePathError: no such node, or a NodePath with an empty component (a KeyError; the message names the
                closest valid NodePaths).
        """
        return _find(self.root, path)

    def all_paths(self) -> list[str]:
        """Every NodePath in the tree, depth first."""
        return _all_paths(self.root)

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
            info: ValueInfo = node.meta.get("gp_info", ValueInfo("?"))
            if node.target is check_shape_guard or isinstance(node.target, OutputRebuilder) or (
                    node.op == "call_function" and info.kind == "NoneType"):
                continue  # guards, the rebuilding of the output, calls for their side effects (``outputs[0] = ...``)
            if node.op == "call_module":
                self._add_module(parent, node.name, module.get_submodule(str(node.target)))
                continue
            code = lines.get(node.name, "") if node.op != "output" else lines.get("return", "")
            constant = node.op == "placeholder" and name not in inputs
            self._add_leaf(parent, name, module, name, info, code or node.format_node(), _operation(node),
                           constant)

    def _fill_opaque(self, parent: NodeData, module: OpaqueGraphModule) -> None:
        infos: dict[str, ValueInfo] = module.infos
        for name, info in infos.items():
            if name != "output":
                kind = "input" if name in module._gp_inputs else "attribute"
                self._add_leaf(parent, name, module, name, info, f"{name}  # opaque module {kind}", f"{kind}:{name}",
                               read_only=module.read_only.get(name, ""))
        for name, child in _flat_children(module._modules, ""):
            self._add_module(parent, name, child)
        if "output" in infos:
            self._add_leaf(parent, "output", module, "output", infos["output"], "return  # opaque module output",
                           "output:output")

    def _add_module(self, parent: NodeData, name: str, module: nn.Module) -> None:
        node = NodeData(_join(parent._path, name), name, module=module, code=_module_code(module))
        parent._gp_children[name] = node
        self._fill_module(node, module)

    def _add_leaf(self, parent: NodeData, name: str, owner: nn.Module, key: str, info: ValueInfo, code: str,
                  op: str, constant: bool = False, read_only: str = "") -> None:
        leaf = NodeData(_join(parent._path, name), name, owner=owner, key=key, info=info, code=code, op=op,
                        constant=constant, read_only=read_only)
        parent._gp_children[name] = leaf
        _add_digs(leaf, info, ())


def _find(start: NodeData, path: str) -> NodeData:
    node_part, _, dig_part = path.partition("|")
    parts = node_part.split(".") if node_part else []
    parts += dig_part.split(".") if dig_part else []
    if "" in parts or "|" in dig_part:
        raise NodePathError(f"NodePath '{path}' has an empty component or a second '|'; write names joined by "
                            f"single dots, e.g. 'model.layers_0.mlp.output', and at most one '|' before digs")
    current = start
    for part in parts:
        child = current._gp_children.get(part)
        if child is None:
            close = difflib.get_close_matches(_join(start._path, path), _all_paths(start), n=5, cutoff=0.6)
            hint = f" Closest valid NodePaths: {', '.join(close)}" if close else ""
            raise NodePathError(f"NodePath '{path}' does not exist (no '{part}' under "
                                f"'{current._path or '<root>'}').{hint}")
        current = child
    return current


def _all_paths(start: NodeData) -> list[str]:
    paths: list[str] = []

    def walk(node: NodeData) -> None:
        for child in node._gp_children.values():
            paths.append(child._path)
            walk(child)

    walk(start)
    return paths


def _flat_children(modules: dict[str, nn.Module | None], prefix: str) -> Iterator[tuple[str, nn.Module]]:
    """An opaque wrapper's submodule wrappers with their NodePath names, containers flattened
    (``module_dict.bar.0`` -> ``module_dict_bar_0``), invocations numbered, never-called slots left out."""
    for name, child in modules.items():
        path = f"{prefix}.{name}" if prefix else name
        if child is None or isinstance(child, UnusedModule):
            continue
        if isinstance(child, MultiplyInvokedModule):
            for index, invocation in enumerate(child):
                yield f"{node_name(path)}_{index}", invocation
        elif isinstance(child, (CompiledGraphModule, OpaqueGraphModule)) or not is_container(child):
            yield node_name(path), child
        else:
            yield from _flat_children(child._modules, path)


def _add_digs(node: NodeData, info: ValueInfo, dig: tuple[str, ...]) -> None:
    for part, item in info.items.items():
        path = f"{node._path}{'.' if dig else '|'}{part}"
        child = NodeData(path, part, owner=node._gp_owner, key=node._gp_key, dig=dig + (part,), info=item,
                         code=node._code, op=f"{node._gp_op}|{part}", constant=node._gp_constant,
                         read_only=node._gp_read_only)
        node._gp_children[part] = child
        _add_digs(child, item, dig + (part,))


def _operation(node: fx.Node) -> str:
    """What a node computes, independent of its numbering: ``call_method:view``, ``placeholder:input``."""
    target = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", repr(node.target))
    return f"{node.op}:{target}"


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _module_code(module: nn.Module) -> str:
    if isinstance(module, CompiledGraphModule):
        original = getattr(module, "original_module", None)
        return graph_code(module, None if original is None else type(original).forward)
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
