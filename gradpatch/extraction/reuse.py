"""Graphs reused across repeated modules: a module called like one traced before gets that module's graph.

A model's repeated blocks (SmolLM2's 30 decoder layers, each with its attention, MLP, norms and linear layers)
trace to the same graphs. Tracing a module is a deterministic function of:

- its class's code (the same class, the same ``forward``) and its call sites (the same paths and classes);
- the instance state its code reads: every attribute read on the module or on a module below it while its code
  runs is recorded (a ``__getattribute__`` on their classes while the first one traces; torch's own reads of
  ``__dict__`` excepted), and each read's value is compared: Python scalars by value (floats by ``repr``), tensors
  by metadata, any other object (a shared config) by identity, assumed not changed by the forward pass itself;
- the call: the constants' values, the inputs' tensor metadata (type, shape, dtype, device, layout, strides,
  ``requires_grad``), grad mode, inference mode and autocast;
- the Python decisions the trace made on traced values: on sizes (guard nodes in the graph), on tensor metadata
  (``x.dtype``, ``x.ndim``: they follow from the above through the graph's operations), and on the outputs of the
  submodules it calls.

So a module gets a template's graph only when all of that is the same: the read attributes and the call are
compared first, then the graph runs on the module's own inputs, parameters and submodules (each submodule
extracted, reused or traced, in turn), its guards checked and the metadata of every parameter it reads, every
submodule output and its output compared with the template's. Anything else (another value, a failed guard, an
exception) falls back to tracing. The module's wrapper then holds the template's ``fx.Graph`` itself (or a copy
when a postprocessing function may edit graphs in place) and its compiled code: the same nodes, names and code,
with the module's own tensors and submodule wrappers.
"""

from __future__ import annotations

import copy
import warnings
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch import fx, nn

from .._torch_compat import set_node_name
from .hierarchy import call_sites
from .inputs import InputPlan
from .reads import ReadRecording, attribute_token, submodule, tensor_token, value_token

__all__ = ["GraphTemplate", "TemplateStore", "graph_reuse_disabled"]

_DISABLED: list[bool] = []


@contextmanager
def graph_reuse_disabled() -> Iterator[None]:
    """Trace every module call inside the block, as if no module repeated another (to compare, or to rule reuse
    out when looking into an extraction)."""
    _DISABLED.append(True)
    try:
        yield
    finally:
        _DISABLED.pop()


def _global_state() -> tuple:
    return (torch.is_grad_enabled(), torch.is_inference_mode_enabled(),
            tuple(torch.is_autocast_enabled(device) for device in ("cpu", "cuda")))


# --- templates ----------------------------------------------------------------------------------------------


@dataclass
class GraphTemplate:
    """A traced module call whose graph other modules may reuse (see the module docstring).

    Attributes:
        forward: the traced ``forward`` function.
        sites: ``(call-site path, class)`` of every submodule call site, in order.
        reads: the recorded attribute reads (:meth:`ReadRecording.tokens`).
        state: grad mode, inference mode, autocast.
        inputs: ``(placeholder target, value token)`` of the call.
        graph: the wrapper's finished graph (names and targets final).
        sources: ``get_attr`` node name -> ``(dotted path of the tensor, its token)``.
        calls: ``call_module`` node name -> ``(site, args, kwargs, output token)``; args hold nodes of ``graph``
            where the call passed traced values, and the constants it passed.
        output: token of the call's output.
        guards: size decisions of the trace.
        code: the wrapper's generated code (a :class:`~gradpatch.extraction.graph_modules.GraphCode`), which the
            modules reusing the graph share.
    """

    forward: Callable[..., Any]
    sites: tuple[tuple[str, type], ...]
    reads: tuple[tuple[str, str, Any], ...]
    state: tuple
    inputs: tuple[tuple[str, Any], ...]
    graph: fx.Graph
    sources: dict[str, tuple[str, Any]]
    calls: dict[str, tuple[str, Any, Any, Any]]
    output: Any
    guards: int
    code: Any


@dataclass
class Replay:
    """A template's graph run on another module: the graph it gets (the template's, or a copy), the module's tensors
    read by ``get_attr`` nodes and its submodules' wrappers (by node name), and the call's output."""

    graph: fx.Graph
    tensors: dict[str, Any]
    wrappers: dict[str, nn.Module]
    output: Any
    template: GraphTemplate


class TemplateStore:
    """The templates of one extraction: per class, the calls traced so far that a repeated module may reuse.

    Args:
        share_graphs: a module reusing a graph holds the template's graph object itself (graphs are not edited
            after extraction); false gives each its own copy (for a postprocessing function that edits graphs in
            place). A graph with guards is always copied (its guards name its module).
    """

    def __init__(self, share_graphs: bool = True) -> None:
        self._share_graphs = share_graphs
        self._repeated: set[type] | None = None
        self._templates: dict[type, list[GraphTemplate]] = {}

    def start(self, root: nn.Module) -> None:
        """Note which classes occur more than once below ``root`` (the only ones worth recording); a model
        dispatched by accelerate (weights moved by hooks) reuses nothing."""
        if self._repeated is not None:
            return
        modules = list(root.modules())
        hooked = any("_hf_hook" in object.__getattribute__(module, "__dict__") for module in modules)
        counts = Counter(type(module) for module in modules)
        self._repeated = set() if hooked else {cls for cls, count in counts.items() if count > 1}

    def records(self, module: nn.Module) -> bool:
        """Whether a trace of ``module`` should be recorded as a template."""
        return not _DISABLED and self._repeated is not None and type(module) in self._repeated

    def add(self, module: nn.Module, recording: ReadRecording, plan: InputPlan, graph: fx.Graph,
            values: dict[str, tuple[str, Any]], calls: dict[str, tuple[str, Any, Any, Any]], output: Any,
            guards: int, code: Any) -> None:
        """Keep a finished trace of ``module`` as a template, unless something in it cannot be compared.

        Args:
            values: ``get_attr`` node name -> (dotted source path, the value the trace read).
            calls: ``call_module`` node name -> (site, args, kwargs, the call's output).
        """
        try:
            reads = recording.tokens()
            if reads is None:
                return
            sources = {}
            for name, (source, value) in values.items():
                if not isinstance(value, torch.Tensor) or _registered(module, source) is not value:
                    return  # an fx-made constant or a plain attribute: not read from the module's registries
                sources[name] = (source, tensor_token(value))
            inputs = tuple((target, value_token(value)) for target, value in plan.placeholders)
            template = GraphTemplate(
                forward=type(module).forward, sites=_site_classes(call_sites(module)), reads=reads,
                state=_global_state(), inputs=inputs, graph=graph, sources=sources,
                calls={name: (site, args, kwargs, value_token(value)) for name, (site, args, kwargs, value)
                       in calls.items()},
                output=value_token(output), guards=guards, code=code)
        except Exception:  # a value whose description fails (an exotic tensor subclass): no template
            return
        self._templates.setdefault(type(module), []).append(template)

    def has(self, module: nn.Module) -> bool:
        """Whether a template of ``module``'s class was recorded (reuse is then worth trying)."""
        return not _DISABLED and type(module) in self._templates

    def candidates(self, module: nn.Module, plan: InputPlan, sites: list[tuple[str, nn.Module]]
                   ) -> Iterator[GraphTemplate]:
        """The templates whose class, code, call sites (:func:`~gradpatch.extraction.hierarchy.call_sites`),
        attribute reads, call and global state match."""
        templates = self._templates.get(type(module))
        if not templates or _DISABLED:
            return
        forward = type(module).forward
        site_classes = _site_classes(sites)
        state = _global_state()
        inputs = None
        for template in templates:
            if template.forward is not forward or template.sites != site_classes or template.state != state:
                continue
            if any(_read_token(module, path, name) != token for path, name, token in template.reads):
                continue
            if inputs is None:
                inputs = tuple((target, value_token(value)) for target, value in plan.placeholders)
            if inputs == template.inputs:
                yield template

    def replay(self, template: GraphTemplate, module: nn.Module, plan: InputPlan,
               extract_child: Callable[[str, tuple, dict], tuple[nn.Module, Any]]) -> Replay | None:
        """Run ``template``'s graph on ``module``'s call (see the module docstring); ``None`` when anything
        differs. ``extract_child(site, args, kwargs)`` extracts one submodule call and returns its wrapper and
        output. Warnings of a failed replay are dropped (the trace that follows gives its own)."""
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                replay = self._run(template, module, plan, extract_child)
            except Exception:  # any failure means: trace instead
                replay = None
        if replay is not None:
            for warning in caught:
                warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)
        return replay

    def _run(self, template: GraphTemplate, module: nn.Module, plan: InputPlan,
             extract_child: Callable[[str, tuple, dict], tuple[nn.Module, Any]]) -> Replay | None:
        inputs = dict(plan.placeholders)
        env: dict[fx.Node, Any] = {}
        tensors: dict[str, Any] = {}
        wrappers: dict[str, nn.Module] = {}
        output: Any = None

        def load(argument: Any) -> Any:
            return _map_nodes(argument, env.__getitem__)

        for node in template.graph.nodes:
            op = node.op
            if op == "placeholder":
                env[node] = inputs[node.target]
            elif op == "get_attr":
                source, token = template.sources[node.name]
                value = _registered(module, source)
                if not isinstance(value, torch.Tensor) or tensor_token(value) != token:
                    return None
                env[node] = tensors[node.name] = value
            elif op == "call_function":
                env[node] = node.target(*load(node.args), **load(node.kwargs))
            elif op == "call_method":
                receiver, *rest = load(node.args)
                env[node] = getattr(receiver, node.target)(*rest, **load(node.kwargs))
            elif op == "call_module":
                site, args, kwargs, token = template.calls[node.name]
                wrapper, value = extract_child(site, load(args), load(kwargs))
                if value_token(value) != token:
                    return None
                env[node], wrappers[node.name] = value, wrapper
            elif op == "output":
                output = load(node.args[0])
        if value_token(output) != template.output:
            return None
        graph = template.graph if self._share_graphs else copy_graph(template.graph)
        return Replay(graph, tensors, wrappers, output, template)


def _read_token(module: nn.Module, path: str, name: str) -> Any:
    target = submodule(module, path)
    return None if target is None else attribute_token(target, name)


def _registered(module: nn.Module, source: str) -> Any:
    """The parameter or buffer at dotted ``source`` through the modules' registries only; ``None`` if none."""
    *parents, name = source.split(".")
    owner = submodule(module, ".".join(parents))
    if owner is None:
        return None
    state = object.__getattribute__(owner, "__dict__")
    for registry in ("_parameters", "_buffers"):
        entries = state.get(registry) or {}
        if name in entries:
            return entries[name]
    return None


def _site_classes(sites: list[tuple[str, nn.Module]]) -> tuple[tuple[str, type], ...]:
    return tuple((path, type(child)) for path, child in sites)


def _map_nodes(argument: Any, fn: Callable[[fx.Node], Any]) -> Any:
    """Replace the nodes in a node's arguments by ``fn(node)``, containers rebuilt as the generated code builds
    them (fx stores lists and dicts as immutable ones; the code makes plain ones)."""
    if isinstance(argument, fx.Node):
        return fn(argument)
    if isinstance(argument, tuple):
        mapped = [_map_nodes(item, fn) for item in argument]
        return type(argument)(*mapped) if hasattr(argument, "_fields") else type(argument)(mapped)
    if isinstance(argument, list):
        return [_map_nodes(item, fn) for item in argument]
    if isinstance(argument, dict):
        return {key: _map_nodes(item, fn) for key, item in argument.items()}
    if isinstance(argument, slice):
        return slice(*(_map_nodes(part, fn) for part in (argument.start, argument.stop, argument.step)))
    return argument


def copy_graph(graph: fx.Graph) -> fx.Graph:
    """A copy of ``graph`` with the same node names (fx would rename a node named after a builtin), metadata and
    code-generation settings."""
    memo: dict[Any, Any] = {}
    copied = copy.deepcopy(graph, memo)
    for old, new in zip(graph.nodes, copied.nodes):
        if new.name != old.name:
            set_node_name(new, old.name)
    if hasattr(graph, "_co_fields"):
        copied._co_fields = graph._co_fields
    return copied
