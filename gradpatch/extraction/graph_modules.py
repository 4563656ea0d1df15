"""The modules a PatchableGraph is built from: compiled graphs, opaque fallbacks and multiply invoked modules.

Every wrapper accepts the original module's calling convention and shares its parameters and buffers (the same
``nn.Parameter`` objects), so gradients, in-place weight edits and ``.to()`` reach the original model. Wrappers
keep the original module hierarchy: ``pg._graph_module.model.layers[3].mlp`` wraps ``model.model.layers[3].mlp``.

Patching cost: a :class:`CompiledGraphModule` runs fx-generated Python code. While no patch is active it runs the
clean code, with no hook at any node. Entering a patch context generates (once per set of patched nodes, then
cached) code that calls :func:`~gradpatch.patch_table.apply_patches` after exactly the patched nodes; the other nodes
cost nothing.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable

from torch import fx, nn

from .._torch_compat import compile_graph_code
from .dispatch import Dispatch
from ..patch_table import PATCH_TABLE_ATTRIBUTE, PatchTable, apply_patches, patched_graph
from ..value_info import ValueInfo


@dataclass(frozen=True)
class GraphCode:
    """A graph's generated forward: its source, fx's line map (for error messages), the compiled function, the key
    under which wrappers share patched versions of it, and the class-level trampoline carrying its signature."""

    src: str
    lineno_map: Any
    prologue_start: int
    forward: Callable[..., Any]
    key: tuple[Any, ...]
    trampoline: Callable[..., Any]


class CompiledGraphModule(fx.GraphModule):
    """A module whose forward is an extracted fx graph; every node is patchable.

    Args:
        root: maps each ``get_attr``/``call_module`` target of ``graph`` to its tensor or wrapper module.
        graph: the extracted graph.
        class_name: the original module's class name (shown in the generated code).
        code: the generated code of an identical graph (:meth:`code_bundle`), used instead of generating it.

    ``_gp_graph_path`` holds the NodePath of the module call the graph was extracted for (``""`` for the root,
    ``None`` where unknown): a failed shape guard names it.
    """

    # Defined here, not inherited, so that torch.fx's patching of nn.Module's __call__ and __getattr__ (four class
    # attribute changes per trace, one trace per submodule call extracted) stops at this class: CPython updates the
    # slots of every subclass of nn.Module that does not define the name itself, and fx makes one class per graph
    # module (about 400 per extraction of SmolLM2), so each change grew slower with every graph extracted (0.2 ms
    # per change before the first extraction, 1.4 ms after two: a third of an extraction's time).
    __call__ = nn.Module.__call__
    __getattr__ = nn.Module.__getattr__

    def __init__(self, root: dict[str, Any] | nn.Module, graph: fx.Graph, class_name: str,
                 code: GraphCode | None = None) -> None:
        # Plain attributes go straight into the instance dict (what nn.Module.__setattr__ does for a value that is
        # neither a tensor nor a module, at a tenth of the cost: a few hundred wrappers per extraction).
        state = self.__dict__
        state["_gp_dispatch"] = None
        state["_gp_given_code"] = code
        state["_gp_graph_path"] = None
        super().__init__(root, graph, class_name)
        state["_gp_patched_forwards"] = {}
        #: wrapper attribute (a ``get_attr`` target) -> dotted path of that tensor in the original module.
        state["_gp_attribute_sources"] = {}
        state[PATCH_TABLE_ATTRIBUTE] = {}

    def recompile(self) -> Any:
        """Generate this graph's code only.

        ``GraphModule.recompile`` also recompiles every GraphModule below (quadratic in the depth of a model's
        hierarchy) and wraps ``__call__`` in an error reporter that costs a call per module on the hot path.
        """
        given, self._gp_given_code = self.__dict__.get("_gp_given_code"), None
        if given is None:
            code, forward = compile_graph_code(self)
            key = (code.src, tuple(sorted((name, id(value)) for name, value in code.globals.items())))
            given = GraphCode(code.src, code._lineno_map, code._prologue_start, forward, key, _trampoline(forward))
        else:
            code = None
        self.__dict__.update(_code=given.src, _lineno_map=given.lineno_map, _prologue_start=given.prologue_start,
                             _gp_clean_forward=given.forward, _gp_patched_forwards={}, _gp_code_key=given.key,
                             _gp_code=given)
        type(self).forward = given.trampoline
        self._install_forward(given.forward)
        return code

    def code_bundle(self) -> GraphCode:
        """This graph's generated and compiled code, for a wrapper around the same graph or an identical one
        (:mod:`gradpatch.extraction.reuse`) to use instead of generating it again."""
        return self._gp_code

    def set_patch_table(self, table: PatchTable) -> None:
        """Activate ``table`` (node name -> patches); an empty table restores the clean, hook-free code."""
        setattr(self, PATCH_TABLE_ATTRIBUTE, table)
        key = frozenset(table)
        if not key:
            self._install_forward(self._gp_clean_forward)
            return
        forward = self._gp_patched_forwards.get(key)
        if forward is None:
            forward = _shared_patched_forward(self, key)
            self._gp_patched_forwards[key] = forward
        self._install_forward(forward)

    def set_dispatch(self, dispatch: Dispatch) -> None:
        """Run accelerate's hook of the original module around this graph (see :mod:`gradpatch.extraction.dispatch`)."""
        self._gp_dispatch = dispatch
        self._install_forward(self._gp_clean_forward)

    def refresh_tensors(self) -> None:
        """Point the graph's parameters and buffers at the original module's current tensors (accelerate swaps
        them in and out when it offloads weights)."""
        source = self.original_module
        for attribute, target in self._gp_attribute_sources.items():
            value = _resolve(source, target)
            registry = self._parameters if attribute in self._parameters else self._buffers
            if attribute in registry:
                registry[attribute] = value

    def _install_forward(self, forward: Callable[..., Any]) -> None:
        dispatch = self._gp_dispatch
        self.__dict__["_gp_forward"] = forward if dispatch is None else dispatch.wrap(forward)


class OpaqueGraphModule(nn.Module):
    """Fallback for a module whose graph could not be extracted: it runs the original forward code.

    Patchable nodes are its inputs (forward argument names), its attributes (parameters, buffers and plain values
    such as ``in_features`` or ``scaling``) and its output; its submodules are wrappers of their own and stay
    patchable.

    Args:
        original: a shallow copy of the original module whose submodules are replaced by wrappers.
        constants: keyword arguments that held non-tensor values on the example inputs; they are filled in when
            a compiled parent (which passes only tensor arguments) calls this module.
        inputs: NodePath name -> forward argument name (``sub_shape`` -> ``_shape``).
        attributes: NodePath name -> attribute name of the patchable attributes (``constants`` ->
            ``__constants__``).
        reason: why extraction failed (shown by ``repr``).
    """

    def __init__(self, original: nn.Module, constants: dict[str, Any], inputs: dict[str, str],
                 attributes: dict[str, str], reason: str) -> None:
        super().__init__()
        object.__setattr__(self, "_gp_original", original)
        self._gp_signature = inspect.signature(original.forward)
        self._gp_constants = constants
        self._gp_inputs = inputs
        self._gp_attributes = attributes
        self._gp_reason = reason
        self._gp_dispatch: Dispatch | None = None
        self._gp_run: Callable[..., Any] = type(self)._run
        #: NodePath name -> description, for each input, attribute and the output.
        self.infos: dict[str, ValueInfo] = {}
        #: NodePath name -> why only probes may read it (quantized weights).
        self.read_only: dict[str, str] = {}
        setattr(self, PATCH_TABLE_ATTRIBUTE, {})
        for name, parameter in original._parameters.items():
            if parameter is not None:
                self.register_parameter(name, parameter)
        for name, buffer in original._buffers.items():
            if buffer is not None:
                self.register_buffer(name, buffer, persistent=name not in original._non_persistent_buffers_set)
        self._modules = original._modules  # the wrapper hierarchy: one dict, seen by the copy's forward too

    def extra_repr(self) -> str:
        return f"{type(self._gp_original).__name__}, reason={self._gp_reason!r}"

    def train(self, mode: bool = True) -> "OpaqueGraphModule":
        super().train(mode)
        self._gp_original.training = mode
        return self

    def set_patch_table(self, table: PatchTable) -> None:
        """Activate ``table`` (node name -> patches) for this module's inputs, attributes and output."""
        setattr(self, PATCH_TABLE_ATTRIBUTE, table)

    def set_dispatch(self, dispatch: Dispatch) -> None:
        """Run accelerate's hook of the original module around this module's forward."""
        self._gp_dispatch = dispatch
        self._gp_run = dispatch.wrap(type(self)._run)

    def refresh_tensors(self) -> None:
        """Point this module's parameters and buffers at the original module's current tensors."""
        source, copy = self.original_module, self._gp_original
        for name in self._parameters:
            self._parameters[name] = copy._parameters[name] = source._parameters[name]
        for name in self._buffers:
            self._buffers[name] = copy._buffers[name] = source._buffers[name]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._gp_run(self, *args, **kwargs)

    def _run(self, *args: Any, **kwargs: Any) -> Any:
        for module in self._gp_original.modules():
            if isinstance(module, MultiplyInvokedModule):
                module.reset_invocations()
        for name, value in self._gp_constants.items():
            kwargs.setdefault(name, value)
        table: PatchTable = getattr(self, PATCH_TABLE_ATTRIBUTE)
        if not table:
            return self._gp_original(*args, **kwargs)
        bound = self._gp_signature.bind(*args, **kwargs)
        bound.apply_defaults()
        for node_name, argument in self._gp_inputs.items():
            if node_name in table:
                bound.arguments[argument] = apply_patches(table, node_name, bound.arguments[argument])
        original = self._gp_original
        restore: list[tuple[dict[str, Any], str, Any]] = []
        try:
            for node_name, attribute in self._gp_attributes.items():
                if node_name in table:
                    registry = _registry_of(original, attribute)
                    restore.append((registry, attribute, registry.get(attribute, _MISSING)))
                    registry[attribute] = apply_patches(table, node_name, getattr(original, attribute))
            output = original(*bound.args, **bound.kwargs)
        finally:
            for registry, attribute, value in reversed(restore):
                if value is _MISSING:
                    registry.pop(attribute, None)
                else:
                    registry[attribute] = value
        if "output" in table:
            output = apply_patches(table, "output", output)
        return output


class MultiplyInvokedModule(nn.ModuleList):
    """A submodule called more than once per forward: each invocation has its own graph (``name_0``, ``name_1``…),
    so invocations can be patched independently. ``pg._graph_module.linear[1]`` is the second call's wrapper.

    Compiled parents call invocation ``i`` directly; opaque parents call this module, which dispatches the
    ``i``-th call of a forward pass to invocation ``i``.
    """

    def __init__(self, invocations: list[nn.Module]) -> None:
        super().__init__(invocations)
        self._gp_next = 0

    def reset_invocations(self) -> None:
        """Start counting calls again (at the beginning of the parent's forward)."""
        self._gp_next = 0

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        index = self._gp_next
        self._gp_next = (index + 1) % len(self)
        return self[index](*args, **kwargs)


class UnusedModule(nn.Module):
    """Stands where a compiled parent never calls a submodule on the example inputs (it has no graph and holds no
    weights); it keeps the original hierarchy's names and indices.

    Raises:
        RuntimeError: when called (the compiled parent's code never calls it).
    """

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("this submodule was never called on the example inputs, so it has no graph")


_MISSING = object()

#: (clean code, its globals' identities, patched node names) -> the patched forward, shared by every graph module
#: whose code is the same (a model's repeated blocks: on SmolLM2 about 370 of 396 graphs have one of a few codes).
_PATCHED_FORWARDS: dict[tuple[Any, ...], Callable[..., Any]] = {}
#: Entries kept at most (the dict is emptied when full; a forward costs a few milliseconds to make again).
_PATCHED_FORWARDS_LIMIT = 4096


def _shared_patched_forward(module: CompiledGraphModule, names: frozenset[str]) -> Callable[..., Any]:
    """The forward of ``module`` patched at ``names`` (:func:`~gradpatch.patch_table.patched_graph`), made once for
    every module with the same code and globals: the generated function reads the module only through ``self``, and
    two graphs whose code and globals are the same generate the same patched code. The cache holds the functions,
    whose globals keep the objects whose identities the key holds alive."""
    key = (*module._gp_code_key, names)
    forward = _PATCHED_FORWARDS.get(key)
    if forward is None:
        if len(_PATCHED_FORWARDS) >= _PATCHED_FORWARDS_LIMIT:
            _PATCHED_FORWARDS.clear()
        forward = _PATCHED_FORWARDS[key] = patched_graph(module.graph, names)
    return forward


def _trampoline(forward: Callable[..., Any]) -> Callable[..., Any]:
    """The class-level ``forward`` of a :class:`CompiledGraphModule`: it runs the instance's active forward
    (``_gp_forward``: the clean code, or the code patched at the active patch set's nodes).

    The active code is an instance attribute, not a method swapped on the class, so that ``torch.compile`` sees a
    change of patch set: dynamo guards on the function object it reads from the instance, and recompiles (once per
    patch set) when another one is installed; it does not guard on a class attribute replaced after compilation.
    The trampoline carries the generated code's signature (``inspect.signature(wrapper.forward)`` binds calls).
    """

    def forward_of_active_patch_set(self: CompiledGraphModule, *args: Any, **kwargs: Any) -> Any:
        return self._gp_forward(self, *args, **kwargs)

    forward_of_active_patch_set.__signature__ = inspect.signature(forward)  # type: ignore[attr-defined]
    return forward_of_active_patch_set


def _registry_of(module: nn.Module, attribute: str) -> dict[str, Any]:
    """The dict holding ``attribute`` on ``module``: its parameters, its buffers or its instance ``__dict__``."""
    if attribute in module._parameters:
        return module._parameters
    if attribute in module._buffers:
        return module._buffers
    return module.__dict__


def _resolve(module: nn.Module, target: str) -> Any:
    for part in target.split("."):
        module = getattr(module, part)
    return module
