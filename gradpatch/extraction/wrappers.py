"""Building a :class:`CompiledGraphModule` wrapper around a finished graph, with the original hierarchy kept around
the submodules' wrappers: for a traced graph (``extractor._compiled_wrapper`` names it first) or a graph reused
from a repeated module (:func:`replayed_wrapper`)."""

from __future__ import annotations

from typing import Any

from torch import fx, nn

from .graph_modules import CompiledGraphModule, GraphCode, MultiplyInvokedModule, UnusedModule
from .hierarchy import assemble, is_structured, node_name, wrapper_target
from .inputs import InputPlan
from ..patch_table import LEAF_NAME
from .reuse import Replay

__all__ = ["assemble_wrapper", "group_calls", "replayed_wrapper"]


def replayed_wrapper(module: nn.Module, replay: Replay, plan: InputPlan, path: str) -> CompiledGraphModule:
    """The wrapper of ``module`` around a template's graph (the same object or a copy; names and targets final),
    holding the module's own tensors and its submodules' wrappers."""
    template, graph = replay.template, replay.graph
    calls: dict[str, list[tuple[fx.Node, nn.Module]]] = {}
    mapping: dict[str, Any] = dict(replay.tensors)
    for node in graph.nodes:
        if node.op == "call_module":
            wrapper = replay.wrappers[node.name]
            calls.setdefault(template.calls[node.name][0], []).append((node, wrapper))
            mapping[str(node.target)] = wrapper
    structured, flat, _ = group_calls(module, calls)
    sources = {name: source for name, (source, _) in template.sources.items()}
    wrapper = assemble_wrapper(module, graph, mapping, structured, flat, sources, plan, type(module).__name__, path,
                        template.code)
    wrapper.training = module.training
    object.__setattr__(wrapper, "original_module", module)
    return wrapper


def group_calls(traced: nn.Module, calls: dict[str, list[tuple[fx.Node, nn.Module]]]
                 ) -> tuple[dict[str, list[nn.Module]], dict[str, list[nn.Module]], dict[fx.Node, str]]:
    """The wrappers of the calls per call site, kept at their structured path (through containers) or flat at
    the site's node name, and each call node's target in the wrapper."""
    flat: dict[str, list[nn.Module]] = {}
    structured: dict[str, list[nn.Module]] = {}
    targets: dict[fx.Node, str] = {}
    for site, entries in calls.items():
        keep = is_structured(traced, site)
        base = wrapper_target(site) if keep else node_name(site)
        (structured if keep else flat)[site if keep else base] = [wrapper for _, wrapper in entries]
        for index, (node, _) in enumerate(entries):
            targets[node] = base if len(entries) == 1 else f"{base}.{index}"
    return structured, flat, targets


def assemble_wrapper(traced: nn.Module, graph: fx.Graph, mapping: dict[str, Any],
                     structured: dict[str, list[nn.Module]], flat: dict[str, list[nn.Module]], sources: dict[str, str],
                     plan: InputPlan, class_name: str, path: str, code: GraphCode | None) -> CompiledGraphModule:
    """Build the wrapper over a finished graph (``code``: its generated code when already compiled for an
    identical graph) for the module call at NodePath ``path``."""
    wrapper = CompiledGraphModule(mapping, graph, class_name, code=code)
    modules = assemble(traced, structured, lambda child, site: UnusedModule(), safe_names=True)
    for base, wrappers in flat.items():
        modules[base] = wrappers[0] if len(wrappers) == 1 else MultiplyInvokedModule(wrappers)
    input_names = [node.meta[LEAF_NAME] for node in graph.nodes
                   if node.op == "placeholder" and node.target in plan.dynamic]
    # plain values: straight into the instance dict (nn.Module.__setattr__ would do the same, slower)
    wrapper.__dict__.update(_modules=modules, _gp_attribute_sources=sources, input_names=input_names,
                            _gp_graph_path=path)
    return wrapper
