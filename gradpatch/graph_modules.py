"""The modules a PatchableGraph is built from: compiled graphs, opaque fallbacks and multiply invoked modules.

Every wrapper accepts the original module's calling convention and shares its parameters and buffers (the same
``nn.Parameter`` objects), so gradients, in-place weight edits and ``.to()`` reach the original model.

Patching cost: a :class:`CompiledGraphModule` runs fx-generated Python code. While no patch is active it runs the
clean code, with no hook at any node. Entering a patch context generates (once per set of patched nodes, then
cached) code that calls :func:`apply_patches` after exactly the patched nodes; the other nodes cost nothing.
"""

from __future__ import annotations

import copy
import inspect
from typing import Any, Callable

from torch import fx, nn
from torch.fx.graph_module import _forward_from_src

from .patches import Patch

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
    """The index into ``value`` that a NodePath dig part names (``sub_2`` for sequences, keys for mappings)."""
    if isinstance(value, (tuple, list)):
        if not part.startswith("sub_") or not part[4:].isdigit():
            raise KeyError(f"dig '{part}' into a {type(value).__name__}: use sub_0 .. sub_{len(value) - 1}")
        return int(part[4:])
    return part


def leaf_name(node: fx.Node) -> str:
    """Name of a graph node in NodePaths: placeholders by their argument name, the rest by node name."""
    if node.op == "placeholder":
        return str(node.target).lstrip("*")
    if node.op == "output":
        return "output"
    return node.name


class CompiledGraphModule(fx.GraphModule):
    """A module whose forward is an extracted fx graph; every node is patchable.

    Args:
        root: maps each ``get_attr``/``call_module`` target of ``graph`` to its tensor or wrapper module.
        graph: the extracted graph.
        class_name: the original module's class name (shown in the generated code).
    """

    def __init__(self, root: dict[str, Any], graph: fx.Graph, class_name: str) -> None:
        super().__init__(root, graph, class_name)
        self._gp_patched_forwards: dict[frozenset[str], Callable[..., Any]] = {}
        setattr(self, PATCH_TABLE_ATTRIBUTE, {})

    def recompile(self) -> Any:
        """Generate this graph's code only.

        ``GraphModule.recompile`` also recompiles every GraphModule below (quadratic in the depth of a model's
        hierarchy) and wraps ``__call__`` in an error reporter that costs a call per module on the hot path.
        """
        code = self._graph.python_code(root_module="self")
        self._code = code.src
        self._lineno_map = code._lineno_map
        self._prologue_start = code._prologue_start
        self._gp_clean_forward = _forward_from_src(self._code, code.globals, getattr(self._graph, "_co_fields", {}))
        self._gp_patched_forwards = {}
        type(self).forward = self._gp_clean_forward
        return code

    def set_patch_table(self, table: PatchTable) -> None:
        """Activate ``table`` (node name -> patches); an empty table restores the clean, hook-free code."""
        setattr(self, PATCH_TABLE_ATTRIBUTE, table)
        key = frozenset(table)
        if not key:
            type(self).forward = self._gp_clean_forward
            return
        forward = self._gp_patched_forwards.get(key)
        if forward is None:
            forward = self._compile_patched(key)
            self._gp_patched_forwards[key] = forward
        type(self).forward = forward

    def _compile_patched(self, names: frozenset[str]) -> Callable[..., Any]:
        patched = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        nodes = list(self.graph.nodes)
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
        code = patched.python_code(root_module="self")
        return _forward_from_src(code.src, code.globals, None)


class OpaqueGraphModule(nn.Module):
    """Fallback for a module whose graph could not be extracted: it runs the original forward code.

    Patchable nodes are its inputs (forward argument names), its own parameters and buffers, and its output;
    its submodules are wrappers of their own and stay patchable.

    Args:
        original: a shallow copy of the original module whose submodules are replaced by wrappers.
        constants: keyword arguments that held non-tensor values on the example inputs; they are filled in when
            a compiled parent (which passes only tensor arguments) calls this module.
        reason: why extraction failed (shown by ``repr``).
    """

    def __init__(self, original: nn.Module, constants: dict[str, Any], reason: str) -> None:
        super().__init__()
        object.__setattr__(self, "_gp_original", original)
        self._gp_signature = inspect.signature(original.forward)
        self._gp_constants = constants
        self._gp_reason = reason
        self._gp_multiply_invoked: list[MultiplyInvokedModule] = []
        setattr(self, PATCH_TABLE_ATTRIBUTE, {})
        for name, parameter in original._parameters.items():
            if parameter is not None:
                self.register_parameter(name, parameter)
        for name, buffer in original._buffers.items():
            if buffer is not None:
                self.register_buffer(name, buffer, persistent=name not in original._non_persistent_buffers_set)

    def extra_repr(self) -> str:
        return f"{type(self._gp_original).__name__}, reason={self._gp_reason!r}"

    def train(self, mode: bool = True) -> "OpaqueGraphModule":
        super().train(mode)
        self._gp_original.training = mode
        return self

    def set_patch_table(self, table: PatchTable) -> None:
        """Activate ``table`` (node name -> patches) for this module's inputs, parameters and output."""
        setattr(self, PATCH_TABLE_ATTRIBUTE, table)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        for module in self._gp_multiply_invoked:
            module.reset_invocations()
        for name, value in self._gp_constants.items():
            kwargs.setdefault(name, value)
        table: PatchTable = getattr(self, PATCH_TABLE_ATTRIBUTE)
        if not table:
            return self._gp_original(*args, **kwargs)
        bound = self._gp_signature.bind(*args, **kwargs)
        for name in list(bound.arguments):
            if name in table:
                bound.arguments[name] = apply_patches(table, name, bound.arguments[name])
        original = self._gp_original
        saved = {name: original._parameters[name] for name in table if name in original._parameters}
        saved_buffers = {name: original._buffers[name] for name in table if name in original._buffers}
        try:
            for name, parameter in saved.items():
                original._parameters[name] = apply_patches(table, name, parameter)
            for name, buffer in saved_buffers.items():
                original._buffers[name] = apply_patches(table, name, buffer)
            output = original(*bound.args, **bound.kwargs)
        finally:
            original._parameters.update(saved)
            original._buffers.update(saved_buffers)
        if "output" in table:
            output = apply_patches(table, "output", output)
        return output


class MultiplyInvokedModule(nn.Module):
    """A submodule called more than once per forward: each invocation has its own graph (``name_0``, ``name_1``…).

    Compiled parents call invocation ``i`` directly; opaque parents call this module, which dispatches the
    ``i``-th call of a forward pass to invocation ``i``.
    """

    def __init__(self, invocations: list[nn.Module]) -> None:
        super().__init__()
        for index, invocation in enumerate(invocations):
            self.add_module(str(index), invocation)
        self._gp_next = 0

    def reset_invocations(self) -> None:
        self._gp_next = 0

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        index = self._gp_next
        self._gp_next = (index + 1) % len(self._modules)
        return self._modules[str(index)](*args, **kwargs)
