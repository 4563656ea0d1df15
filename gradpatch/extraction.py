"""Recursive extraction: turn a module and every submodule it calls into wrapper modules with graphs.

Each module call seen while running the example inputs is extracted on its own, from the concrete arguments of
that call, with its submodule calls as leaves. A module whose graph cannot be extracted becomes an
:class:`OpaqueGraphModule` running its original code, and extraction continues inside it. A module called more
than once by the same parent gets one graph per call inside a :class:`MultiplyInvokedModule`.
"""

from __future__ import annotations

import inspect
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

from .errors import ExtractionError
from .graph_modules import CompiledGraphModule, MultiplyInvokedModule, OpaqueGraphModule
from .options import ExtractionOptions
from .tracer import ValueTracer, concrete_execution, contains_proxy, resolve_attribute
from .values import describe, holds_tensor

@dataclass
class _InputPlan:
    """How the example call's arguments map to graph placeholders."""

    bound: inspect.BoundArguments
    placeholders: list[tuple[str, Any]]  # (placeholder target, example value)
    dynamic: set[str]  # placeholder targets that received tensors


class Extractor:
    """Extracts wrappers for module calls; one instance per PatchableGraph construction."""

    def __init__(self, options: ExtractionOptions) -> None:
        self.options = options
        self.guard_count = 0  # size-dependent Python decisions in the graphs extracted so far

    def extract(self, module: nn.Module, args: tuple, kwargs: dict, path: str) -> tuple[nn.Module, Any]:
        """Extract the wrapper for one call ``module(*args, **kwargs)`` (concrete values).

        Returns:
            ``(wrapper, output)``: the wrapper module and the call's output on these arguments.

        Raises:
            ExtractionError: with ``error_on_compilation_failure`` when no graph can be extracted.
        """
        options = self.options
        if options.skip_compilation or type(module) in options.classes_to_skip_compiling:
            return self._opaque(module, args, kwargs, path, "skipped by ExtractionOptions")
        try:
            return self._compile(module, args, kwargs, path)
        except Exception as error:  # any failure to trace means: run the original code instead
            where = f"'{path or '<root>'}' ({type(module).__name__})"
            if options.error_on_compilation_failure:
                raise ExtractionError(f"could not extract a graph for {where}: {error}") from error
            reason = f"{type(error).__name__}: {error}"
            if options.warn_on_compilation_failure:
                warnings.warn(f"gradpatch: {where} is opaque: {reason}", stacklevel=2)
            return self._opaque(module, args, kwargs, path, reason)

    # --- compiled ------------------------------------------------------------------------------------------

    def _compile(self, module: nn.Module, args: tuple, kwargs: dict, path: str) -> tuple[nn.Module, Any]:
        custom = self.options.custom_extraction_functions.get(type(module))
        traced = custom(module) if custom is not None else module
        root = _shallow_copy(traced)
        plan = _plan_inputs(traced, args, kwargs)
        children: dict[fx.Node, nn.Module] = {}

        def on_child_call(tracer: ValueTracer, child: nn.Module, name: str, args: tuple, kwargs: dict) -> Any:
            node_name = name.replace(".", "_")
            child_path = f"{path}.{node_name}" if path else node_name
            wrapper, output = self.extract(child, tracer.value_of(args), tracer.value_of(kwargs), child_path)
            # Compiled parents pass what holds tensors; constants are baked into the child (or kept by it).
            node_kwargs = {key: value for key, value in kwargs.items() if contains_proxy(value)}
            proxy = tracer.create_proxy_with_value("call_module", node_name, tuple(args), node_kwargs, output)
            children[proxy.node] = wrapper
            return proxy

        def call(proxies: list[Any]) -> Any:
            by_target = dict(zip((target for target, _ in plan.placeholders), proxies))
            call_args, call_kwargs = _substitute(plan, by_target)
            return type(traced).forward(root, *call_args, **call_kwargs)

        tracer = ValueTracer(on_child_call)
        graph = tracer.trace_call(root, plan.placeholders, call)
        tracer.insert_guards(path)
        self.guard_count += len(tracer.guards)
        output = fx.map_arg(graph.output_node().args[0], tracer.values.__getitem__)
        for node in graph.nodes:
            node.meta["gp_info"] = describe(output if node.op == "output" else tracer.values.get(node))
        wrapper = CompiledGraphModule(_name_children_and_attributes(graph, root, children), graph, type(module).__name__)
        _install_multiply_invoked(wrapper, children)
        wrapper.input_names = [target for target, _ in plan.placeholders if target in plan.dynamic]
        wrapper.training = module.training
        object.__setattr__(wrapper, "original_module", module)
        return wrapper, output

    # --- opaque --------------------------------------------------------------------------------------------

    def _opaque(self, module: nn.Module, args: tuple, kwargs: dict, path: str, reason: str) -> tuple[nn.Module, Any]:
        copy = _shallow_copy(module)
        recorders: dict[str, _Recorder] = {}
        for name, child in module._modules.items():
            if child is not None:
                copy._modules[name] = self._stand_in(child, name, path, recorders)
        with concrete_execution():  # runs concretely, outside the patches of the tracers of its parents
            output = copy(*args, **kwargs)
        wrappers = {name: recorder.finish() for name, recorder in recorders.items()}
        for container_path, recorder in recorders.items():
            _replace_in(copy, container_path, wrappers[container_path] or recorder.module)
        signature = inspect.signature(copy.forward)
        bound = signature.bind(*args, **kwargs)
        inputs = [name for name, value in bound.arguments.items() if holds_tensor(value)]
        constants = {name: value for name, value in kwargs.items() if not holds_tensor(value)}
        wrapper = OpaqueGraphModule(copy, constants, reason)
        for name, child_wrapper in wrappers.items():
            if child_wrapper is not None:
                wrapper.add_module(name.replace(".", "_"), child_wrapper)
                if isinstance(child_wrapper, MultiplyInvokedModule):
                    wrapper._gp_multiply_invoked.append(child_wrapper)
        infos = {name: describe(bound.arguments[name]) for name in inputs}
        infos.update({name: describe(tensor) for name, tensor in module._parameters.items() if tensor is not None})
        infos.update({name: describe(tensor) for name, tensor in module._buffers.items() if tensor is not None})
        infos["output"] = describe(output)
        wrapper.infos = infos
        wrapper.training = module.training
        object.__setattr__(wrapper, "original_module", module)
        return wrapper, output

    def _stand_in(self, child: nn.Module, name: str, path: str, recorders: dict[str, "_Recorder"]) -> nn.Module:
        if type(child).forward is nn.Module.forward:  # a container (ModuleList, ModuleDict): stand in for items
            container = _shallow_copy(child)
            for item_name, item in child._modules.items():
                if item is not None:
                    container._modules[item_name] = self._stand_in(item, f"{name}.{item_name}", path, recorders)
            return container
        node_name = name.replace(".", "_")
        recorder = _Recorder(self, child, f"{path}.{node_name}" if path else node_name)
        recorders[name] = recorder
        return recorder


class _Recorder(nn.Module):
    """Stands in for a submodule while an opaque parent runs the example: extracts each call it receives."""

    def __init__(self, extractor: Extractor, module: nn.Module, path: str) -> None:
        super().__init__()
        object.__setattr__(self, "module", module)
        object.__setattr__(self, "extractor", extractor)
        self.path = path
        self.wrappers: list[nn.Module] = []

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        wrapper, output = self.extractor.extract(self.module, args, kwargs, self.path)
        self.wrappers.append(wrapper)
        return output

    def finish(self) -> nn.Module | None:
        if not self.wrappers:
            return None
        if len(self.wrappers) == 1:
            return self.wrappers[0]
        return MultiplyInvokedModule(self.wrappers)


# --- helpers ---------------------------------------------------------------------------------------------------


def _shallow_copy(module: nn.Module) -> nn.Module:
    """A new module object sharing parameters, buffers and submodules, with its own registries."""
    copy = object.__new__(type(module))
    copy.__dict__ = dict(module.__dict__)
    copy._parameters = dict(module._parameters)
    copy._buffers = dict(module._buffers)
    copy._modules = dict(module._modules)
    return copy


def _plan_inputs(module: nn.Module, args: tuple, kwargs: dict) -> _InputPlan:
    """Bind the example call to ``module.forward`` and decide one placeholder per argument.

    Arguments holding tensors become inputs of the graph; the others are constants baked into it (their
    placeholders stay in the generated signature so that callers keep the original calling convention).
    ``*args`` items become ``args_0``, ``args_1``…; ``**kwargs`` items become placeholders named by their keys.
    """
    signature = inspect.signature(type(module).forward)
    bound = signature.bind(module, *args, **kwargs)
    placeholders: list[tuple[str, Any]] = []
    var_keyword: str | None = None
    for index, parameter in enumerate(signature.parameters.values()):
        if index == 0:
            continue  # self
        value = bound.arguments.get(parameter.name)
        if parameter.kind is inspect.Parameter.VAR_POSITIONAL:
            placeholders += [(f"{parameter.name}_{i}", item) for i, item in enumerate(value or ())]
        elif parameter.kind is inspect.Parameter.VAR_KEYWORD:
            var_keyword = parameter.name
            placeholders += list((value or {}).items())
        else:
            placeholders.append((parameter.name, value))
    dynamic = {target for target, value in placeholders if holds_tensor(value)}
    if var_keyword is not None:
        placeholders.append((f"**{var_keyword}", {}))
    return _InputPlan(bound=bound, placeholders=placeholders, dynamic=dynamic)


def _substitute(plan: _InputPlan, proxies: dict[str, Any]) -> tuple[list[Any], dict[str, Any]]:
    """The example call (``self`` dropped) as ``(args, kwargs)`` with graph inputs replaced by placeholder proxies.

    Arguments go by keyword except positional-only ones and those before a non-empty ``*args``.
    """
    parameters = list(plan.bound.signature.parameters.values())[1:]
    arguments = plan.bound.arguments
    var_positional = next((p for p in parameters if p.kind is inspect.Parameter.VAR_POSITIONAL), None)
    positional_until = parameters.index(var_positional) if var_positional and arguments.get(var_positional.name) else 0
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    for index, parameter in enumerate(parameters):
        name = parameter.name
        if name not in arguments:
            continue
        value = arguments[name]
        if parameter.kind is inspect.Parameter.VAR_POSITIONAL:
            args.extend(proxies[f"{name}_{i}"] if f"{name}_{i}" in plan.dynamic else item for i, item in enumerate(value))
        elif parameter.kind is inspect.Parameter.VAR_KEYWORD:
            kwargs.update({key: proxies[key] if key in plan.dynamic else item for key, item in value.items()})
        else:
            value = proxies[name] if name in plan.dynamic else value
            if parameter.kind is inspect.Parameter.POSITIONAL_ONLY or index < positional_until:
                args.append(value)
            else:
                kwargs[name] = value
    return args, kwargs


def _name_children_and_attributes(graph: fx.Graph, root: nn.Module, children: dict[fx.Node, nn.Module]) -> dict:
    """Give every ``get_attr``/``call_module`` node a flat target equal to its name; map targets to objects.

    A submodule called several times gets nodes ``name_0``, ``name_1``… with targets ``name.0``, ``name.1``….
    """
    mapping: dict[str, Any] = {}
    by_base: dict[str, list[fx.Node]] = {}
    for node in graph.nodes:
        if node.op == "get_attr":
            obj = resolve_attribute(root, str(node.target))
            node.target = node.name
            mapping[node.name] = obj
        elif node.op == "call_module":
            by_base.setdefault(str(node.target), []).append(node)
    for base, nodes in by_base.items():
        if len(nodes) == 1:
            nodes[0].target = nodes[0].name
            mapping[nodes[0].name] = children[nodes[0]]
            continue
        for index, node in enumerate(nodes):
            node._rename(f"{base}_{index}")
            node.target = f"{base}.{index}"
            mapping[node.target] = children[node]
    return mapping


def _install_multiply_invoked(wrapper: CompiledGraphModule, children: dict[fx.Node, nn.Module]) -> None:
    groups: dict[str, list[nn.Module]] = {}
    for node in wrapper.graph.nodes:
        if node.op == "call_module" and "." in str(node.target):
            base, _ = str(node.target).split(".")
            groups.setdefault(base, []).append(children[node])
    for base, invocations in groups.items():
        setattr(wrapper, base, MultiplyInvokedModule(invocations))


def _replace_in(module: nn.Module, path: str, replacement: nn.Module) -> None:
    *parents, last = path.split(".")
    owner = module
    for part in parents:
        owner = owner._modules[part]
    owner._modules[last] = replacement
