"""Recursive extraction: turn a module and every submodule it calls into wrapper modules with graphs.

Each module call seen while running the example inputs is extracted on its own, from the concrete arguments of
that call, with its submodule calls as leaves. A module whose graph cannot be extracted becomes an
:class:`OpaqueGraphModule` running its original code, and extraction continues inside it. A submodule called more
than once through one attribute path gets one graph per call inside a :class:`MultiplyInvokedModule`; one never
called stands as an :class:`UnusedModule` (compiled parents) or an opaque wrapper that was never run (opaque
parents, whose code may still call it).
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any

from torch import fx, nn

from .attributes import attribute_value, patchable_attributes
from .dispatch import Dispatch, accelerate_hook, run_hooked
from ..errors import CompilationWarning, ExtractionError
from .compilable_ops import compilable_target
from .graph_modules import CompiledGraphModule, MultiplyInvokedModule, OpaqueGraphModule, UnusedModule
from .hierarchy import (
    assemble,
    call_sites,
    node_name,
    shallow_copy,
    stand_ins,
    with_call_sites,
)
from .inputs import InputPlan, plan_inputs, substitute
from .naming import assign_node_names, unique_names
from .options import ExtractionOptions
from ..patch_table import LEAF_NAME
from .reads import ReadRecording
from .reuse import TemplateStore
from .tracer import ValueTracer, check_traceable, concrete_execution, contains_proxy, map_proxies, resolve_attribute
from ..value_info import ValueInfo, describe, holds_input
from .wrappers import assemble_wrapper, group_calls, replayed_wrapper

__all__ = [
    "CompiledGraphModule",
    "ExtractionOptions",
    "Extractor",
    "MultiplyInvokedModule",
    "OpaqueGraphModule",
    "UnusedModule",
]

_NEVER_CALLED = "never called on the example inputs"
#: Packages whose modules are never traced: bitsandbytes' quantized layers keep state objects that their forward
#: fills in (tracing would leave proxies there); they are opaque, with patchable inputs, outputs and attributes.
_OPAQUE_PACKAGES = ("bitsandbytes.",)


class Extractor:
    """Extracts wrappers for module calls; one instance per PatchableGraph construction."""

    def __init__(self, options: ExtractionOptions) -> None:
        self.options = options
        self.guard_count = 0  # size-dependent Python decisions in the graphs extracted so far
        # graphs that repeated modules may reuse (gradpatch.extraction.reuse)
        self.templates = TemplateStore(share_graphs=options.postprocessing_function is None)

    def extract(self, module: nn.Module, args: tuple, kwargs: dict, path: str) -> tuple[nn.Module, Any]:
        """Extract the wrapper for one call ``module(*args, **kwargs)`` (concrete values).

        A module dispatched by accelerate runs its hook around the extraction (weights loaded, inputs moved), and
        its wrapper runs the hook on every call.

        Returns:
            ``(wrapper, output)``: the wrapper module and the call's output on these arguments.

        Raises:
            ExtractionError: with ``error_on_compilation_failure`` when no graph can be extracted, or (unless
                ``allow_unused_submodules``) when a submodule of a compiled module is never called.
        """
        self.templates.start(module)  # the first call is the root's
        hook = accelerate_hook(module)
        if hook is None:
            return self._extract(module, args, kwargs, path)
        built: list[nn.Module] = []

        def forward(args: tuple, kwargs: dict) -> Any:
            wrapper, output = self._extract(module, args, kwargs, path)
            built.append(wrapper)
            return output

        with concrete_execution():  # accelerate's own code must see tensors, not the parent tracer's proxies
            output = run_hooked(module, hook, args, kwargs, forward)
        wrapper = built[0]
        dispatch = Dispatch(module, hook, wrapper)
        wrapper.set_dispatch(dispatch)  # type: ignore[operator]
        dispatch.refresh()
        return wrapper, output

    def _extract(self, module: nn.Module, args: tuple, kwargs: dict, path: str) -> tuple[nn.Module, Any]:
        options = self.options
        if options.skip_compilation or type(module) in options.classes_to_skip_compiling:
            return self._opaque(module, args, kwargs, path, "skipped by ExtractionOptions")
        if type(module).__module__.startswith(_OPAQUE_PACKAGES):
            return self._opaque(module, args, kwargs, path, f"{type(module).__module__} layers run as they are")
        try:
            return self._compile(module, args, kwargs, path)
        except Exception as error:  # any failure to trace means: run the original code instead
            where = f"'{path or '<root>'}' ({type(module).__name__})"
            if options.error_on_compilation_failure:
                raise ExtractionError(f"could not extract a graph for {where}: {error}") from error
            reason = f"{type(error).__name__}: {error}"
            if options.warn_on_compilation_failure:
                warnings.warn(f"gradpatch: {where} is opaque: {reason}", CompilationWarning, stacklevel=2)
            return self._opaque(module, args, kwargs, path, reason)

    # --- compiled ------------------------------------------------------------------------------------------

    def _compile(self, module: nn.Module, args: tuple, kwargs: dict, path: str) -> tuple[nn.Module, Any]:
        traced = module
        custom = self.options.custom_extraction_functions.get(type(module))
        if custom is not None:
            replacement = custom(module)
            if isinstance(replacement, fx.Graph):
                wrapper, output = _from_graph(module, replacement, args, kwargs)
                wrapper._gp_graph_path = path
                return wrapper, output
            traced = replacement
        check_traceable(type(traced).forward)
        plan = plan_inputs(traced, args, kwargs)
        if custom is None and self.templates.has(module):
            reused = self._reuse(module, plan, path)
            if reused is not None:
                return reused
        root, sites = with_call_sites(traced)
        recording = None
        if custom is None and self.templates.records(module):
            try:
                recording = ReadRecording(module, [(copy, name) for name, copy in root.named_modules(
                    remove_duplicate=False)])
            except (TypeError, AttributeError):  # its classes cannot be instrumented: traced, never reused
                recording = None
        calls: dict[str, list[tuple[fx.Node, nn.Module]]] = {}
        call_records: dict[fx.Node, tuple[str, Any, Any, Any]] = {}

        def on_child_call(tracer: ValueTracer, child: nn.Module, name: str, args: tuple, kwargs: dict) -> Any:
            site, original = sites.get(id(child), (name, child))
            if recording is not None:
                recording.active = False  # the child's extraction is not this module's code
            try:
                wrapper, output = self.extract(original, tracer.value_of(args), tracer.value_of(kwargs),
                                               _join(path, node_name(site)))
            finally:
                if recording is not None:
                    recording.active = True
            # Compiled parents pass what holds tensors; constants are baked into the child (or kept by it).
            node_kwargs = {key: value for key, value in kwargs.items() if contains_proxy(value)}
            proxy = tracer.create_proxy_with_value("call_module", site, tuple(args), node_kwargs, output)
            calls.setdefault(site, []).append((proxy.node, wrapper))
            if recording is not None and id(child) in sites:
                call_records[proxy.node] = (site, map_proxies(tuple(args), _node_of), map_proxies(kwargs, _node_of),
                                            output)
            return proxy

        def call(proxies: list[Any]) -> Any:
            by_target = dict(zip((target for target, _ in plan.placeholders), proxies))
            call_args, call_kwargs = substitute(plan, by_target)
            if recording is not None:
                recording.active = True
            try:
                return type(traced).forward(root, *call_args, **call_kwargs)
            finally:
                if recording is not None:
                    recording.active = False

        tracer = ValueTracer(on_child_call)
        try:
            graph = tracer.trace_call(root, plan.placeholders, call)
        finally:
            if recording is not None:
                recording.stop()
        tracer.insert_guards()
        self.guard_count += len(tracer.guards)
        output = tracer.output_value
        for node in graph.nodes:
            value = output if node.op == "output" else tracer.values.get(node)
            if node.op == "get_attr" and node not in tracer.values:  # a tensor constant fx stored itself
                value = resolve_attribute(root, str(node.target))
            node.meta["gp_info"] = describe(value)
        self._check_unused({site for site, _ in sites.values()} - set(calls), path)
        attribute_values = {node: tracer.values.get(node) for node in graph.nodes if node.op == "get_attr"}
        wrapper = _compiled_wrapper(traced, root, graph, calls, plan, type(module).__name__, path)
        wrapper.training = module.training
        object.__setattr__(wrapper, "original_module", module)
        if recording is not None and len(call_records) == sum(len(entries) for entries in calls.values()):
            sources = wrapper._gp_attribute_sources
            self.templates.add(module, recording, plan, graph,
                               {node.name: (sources[node.name], value) for node, value in attribute_values.items()},
                               {node.name: record for node, record in call_records.items()}, output,
                               len(tracer.guards), wrapper.code_bundle())
        return wrapper, output

    def _reuse(self, module: nn.Module, plan: InputPlan, path: str) -> tuple[nn.Module, Any] | None:
        """The wrapper and output of this call from a template of an earlier module, if one provably fits
        (:mod:`gradpatch.extraction.reuse`); ``None`` to trace."""
        sites = call_sites(module)
        by_site = dict(sites)

        def extract_child(site: str, args: tuple, kwargs: dict) -> tuple[nn.Module, Any]:
            return self.extract(by_site[site], args, kwargs, _join(path, node_name(site)))

        for template in self.templates.candidates(module, plan, sites):
            guard_count = self.guard_count
            replay = self.templates.replay(template, module, plan, extract_child)
            if replay is None:
                self.guard_count = guard_count
                continue
            self.guard_count += template.guards
            called = {record[0] for record in template.calls.values()}
            self._check_unused(set(by_site) - called, path)
            wrapper = replayed_wrapper(module, replay, plan, path)
            return wrapper, replay.output
        return None

    def _check_unused(self, unused: set[str], path: str) -> None:
        options = self.options
        for site in sorted(unused):
            where = _join(path, node_name(site))
            if not options.allow_unused_submodules:
                raise ExtractionError(
                    f"submodule '{where}' was {_NEVER_CALLED}; pass ExtractionOptions(allow_unused_submodules=True) "
                    f"to allow it, or example inputs that reach it")
            if options.warn_on_compilation_failure:
                warnings.warn(f"gradpatch: unable to compile '{where}'; it was {_NEVER_CALLED}", CompilationWarning,
                              stacklevel=3)

    # --- opaque --------------------------------------------------------------------------------------------

    def _opaque(self, module: nn.Module, args: tuple, kwargs: dict, path: str, reason: str) -> tuple[nn.Module, Any]:
        copy = shallow_copy(module)
        recorders: dict[str, _Recorder] = {}

        def stand_in(child: nn.Module, site: str) -> nn.Module:
            recorders[site] = _Recorder(self, child, _join(path, node_name(site)))
            return recorders[site]

        copy._modules = stand_ins(module, stand_in)
        with concrete_execution():  # runs concretely, outside the patches of the tracers of its parents
            output = copy(*args, **kwargs)
        wrappers = {site: recorder.wrappers for site, recorder in recorders.items()}
        copy._modules = assemble(module, wrappers, lambda child, site: self._never_run(child, _join(path, site)),
                                 safe_names=False)
        bound = inspect.signature(copy.forward).bind(*args, **kwargs)
        bound.apply_defaults()
        constants = {name: value for name, value in kwargs.items() if not holds_input(value)}
        wrapper = _opaque_wrapper(module, copy, constants, reason,
                                  {name: describe(value) for name, value in bound.arguments.items()}, describe(output))
        return wrapper, output

    def _never_run(self, module: nn.Module, path: str) -> nn.Module:
        """An opaque wrapper for a submodule its opaque parent never called (no shapes are known)."""
        copy = shallow_copy(module)
        copy._modules = assemble(module, {}, lambda child, site: self._never_run(child, _join(path, site)),
                                 safe_names=False)
        unknown = ValueInfo.unknown()
        inputs = {name: unknown for name in inspect.signature(copy.forward).parameters}
        return _opaque_wrapper(module, copy, {}, _NEVER_CALLED, inputs, unknown, unknown)


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


# --- building wrappers ----------------------------------------------------------------------------------------


def _compiled_wrapper(traced: nn.Module, root: nn.Module, graph: fx.Graph,
                      calls: dict[str, list[tuple[fx.Node, nn.Module]]], plan: InputPlan,
                      class_name: str, path: str) -> CompiledGraphModule:
    """Name the call sites, point ``get_attr`` nodes at flat attributes, and build the wrapper with the original
    hierarchy around the children's wrappers."""
    structured, flat, targets = group_calls(traced, calls)
    names = {}
    for site, entries in calls.items():
        for index, (node, _) in enumerate(entries):
            names[node] = node_name(site) if len(entries) == 1 else f"{node_name(site)}_{index}"
    assign_node_names(graph, names)
    mapping: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for node in graph.nodes:
        if node.op == "get_attr":
            sources[node.name] = str(node.target)
            mapping[node.name] = resolve_attribute(root, str(node.target))
            node.target = node.name
        elif node.op == "call_module":
            node.target = targets[node]
            mapping[node.target] = _wrapper_at(calls, node)
        elif node.op == "call_function":  # eager-only kernels (torch._grouped_mm) made compilable
            node.target = compilable_target(node.target)
    placeholders = [node for node in graph.nodes if node.op == "placeholder"]
    others = {node.name for node in graph.nodes if node.op != "placeholder"} | {"output"}
    for node, name in zip(placeholders, unique_names([str(node.target).lstrip("*") for node in placeholders],
                                                     others)):
        node.meta[LEAF_NAME] = name
    return assemble_wrapper(traced, graph, mapping, structured, flat, sources, plan, class_name, path, None)


def _wrapper_at(calls: dict[str, list[tuple[fx.Node, nn.Module]]], node: fx.Node) -> nn.Module:
    for entries in calls.values():
        for candidate, wrapper in entries:
            if candidate is node:
                return wrapper
    raise AssertionError(f"no wrapper recorded for {node.name}")


def _node_of(proxy: fx.Proxy) -> fx.Node:
    return proxy.node


def _from_graph(module: nn.Module, graph: fx.Graph, args: tuple, kwargs: dict) -> tuple[nn.Module, Any]:
    """A wrapper from a graph built by a custom extraction function (its ``get_attr`` and ``call_module`` targets
    resolve against ``module``; called submodules run as they are, without graphs of their own)."""
    wrapper = CompiledGraphModule(module, graph, type(module).__name__)
    values: dict[fx.Node, Any] = {}

    class _Recording(fx.Interpreter):
        def run_node(self, node: fx.Node) -> Any:
            values[node] = super().run_node(node)
            return values[node]

    bound = inspect.signature(wrapper.forward).bind(*args, **kwargs)
    output = _Recording(wrapper).run(*bound.arguments.values())
    for node in graph.nodes:
        node.meta["gp_info"] = describe(values.get(node))
    wrapper._gp_attribute_sources = {str(node.target): str(node.target) for node in graph.nodes
                                     if node.op == "get_attr"}
    wrapper.input_names = [str(node.target).lstrip("*") for node in graph.nodes
                           if node.op == "placeholder" and holds_input(values.get(node))]
    wrapper.training = module.training
    object.__setattr__(wrapper, "original_module", module)
    return wrapper, output


def _opaque_wrapper(module: nn.Module, copy: nn.Module, constants: dict[str, Any], reason: str,
                    inputs: dict[str, ValueInfo], output: ValueInfo,
                    attribute_info: ValueInfo | None = None) -> OpaqueGraphModule:
    """An OpaqueGraphModule over ``copy``, with NodePath names for its inputs and attributes. The first input of
    a linear layer is ``input`` whatever its argument name (bitsandbytes' layers call it ``x``), as for
    ``nn.Linear``; quantized weights (bitsandbytes' parameter classes) can be read by probes but not patched."""
    attributes = patchable_attributes(module)
    arguments = list(inputs)
    shown = ["input" if index == 0 and isinstance(module, nn.Linear) else name for index, name in enumerate(arguments)]
    names = unique_names([*shown, *attributes.values()], reserved={"output"})
    input_names = dict(zip(names, arguments))
    attribute_names = dict(zip(names[len(inputs):], attributes.values()))
    wrapper = OpaqueGraphModule(copy, constants, input_names, attribute_names, reason)
    wrapper.read_only = {node: f"'{attribute}' of {type(module).__name__} is quantized storage"
                         for node, attribute in attribute_names.items()
                         if type(attribute_value(module, attribute)).__module__.startswith(_OPAQUE_PACKAGES)}
    infos = {node: inputs[argument] for node, argument in input_names.items()}
    for node, attribute in attribute_names.items():
        infos[node] = attribute_info if attribute_info is not None else describe(attribute_value(module, attribute))
    infos["output"] = output
    wrapper.infos = infos
    wrapper.training = module.training
    object.__setattr__(wrapper, "original_module", module)
    return wrapper


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name
