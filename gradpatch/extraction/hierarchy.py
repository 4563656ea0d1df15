"""Call sites: which attribute path of a module each submodule call goes through, and the wrapper hierarchy.

A submodule reachable under several names (``self.linear`` and ``self.duped_linear`` holding one ``nn.Linear``)
is one *call site* per name, as the model's code reads: each gets its own node (``duped_linear``,
``module_dict_foo``). Calls through one site more than once become ``name_0``, ``name_1``… Wrappers keep the
original hierarchy (containers included), so ``pg._graph_module.model.layers[3]`` wraps ``model.model.layers[3]``.
"""

from __future__ import annotations

from typing import Callable

from torch import nn

from .graph_modules import MultiplyInvokedModule

#: Submodule names that would shadow GraphModule internals or NodePath attributes: they get a ``_`` suffix.
RESERVED_MODULE_NAMES = frozenset({"_code", "code", "_graph", "graph", "_tracer_cls", "_tracer_extras", "meta",
                                   "_shape", "_path", "forward", "training"})
#: Leaf names that NodePaths reserve for themselves: they get a ``sub`` prefix (``_shape`` -> ``sub_shape``).
RESERVED_LEAF_NAMES = frozenset({"_code", "_shape", "_path"})

#: The attributes accelerate adds to a module it hooks; a copy runs the class's forward instead.
_ACCELERATE_ATTRIBUTES = ("forward", "_old_forward", "_hf_hook")


def is_container(module: nn.Module) -> bool:
    """Whether ``module`` only holds submodules (``ModuleList``, ``ModuleDict``): it has no forward of its own."""
    return type(module).forward is nn.Module.forward


def safe_module_name(name: str) -> str:
    """``name`` with a ``_`` suffix if it is reserved (see :data:`RESERVED_MODULE_NAMES`)."""
    return f"{name}_" if name in RESERVED_MODULE_NAMES else name


def node_name(path: str) -> str:
    """The NodePath component for a call site at dotted ``path``: ``module_dict.bar.0`` -> ``module_dict_bar_0``;
    names that are not identifiers get a ``sub_`` prefix (``0`` -> ``sub_0``)."""
    flat = "_".join(safe_module_name(part) for part in path.split("."))
    return flat if flat.isidentifier() else f"sub_{flat}"


def leaf_node_name(name: str, prefix_reserved: bool = True) -> str:
    """The NodePath component for an input or attribute: dunders stripped (``__constants__`` -> ``constants``),
    reserved names prefixed (``_shape`` -> ``sub_shape``) unless ``prefix_reserved`` is false."""
    if name.startswith("__") and name.endswith("__") and len(name) > 4:
        name = name[2:-2]
    return f"sub{name}" if prefix_reserved and name in RESERVED_LEAF_NAMES else name


def shallow_copy(module: nn.Module) -> nn.Module:
    """A new module object sharing parameters, buffers and submodules, with its own registries.

    accelerate's per-instance ``forward`` (which would run the original module's hook and code) is left out:
    wrappers run the hook themselves (:mod:`gradpatch.extraction.dispatch`).
    """
    copy = object.__new__(type(module))
    copy.__dict__ = dict(module.__dict__)
    if "_hf_hook" in copy.__dict__:
        for name in _ACCELERATE_ATTRIBUTES:
            copy.__dict__.pop(name, None)
    copy._parameters = dict(module._parameters)
    copy._buffers = dict(module._buffers)
    copy._modules = dict(module._modules)
    return copy


def stand_ins(module: nn.Module, make: Callable[[nn.Module, str], nn.Module]) -> dict[str, nn.Module | None]:
    """``module``'s submodules with ``make(child, path)`` standing in for each one reachable through containers
    (containers are copied around them); the result is a ``_modules`` dict for a copy of ``module``."""

    def build(child: nn.Module, path: str) -> nn.Module:
        if not is_container(child):
            return make(child, path)
        copy = shallow_copy(child)
        copy._modules = {name: None if item is None else build(item, f"{path}.{name}")
                         for name, item in child._modules.items()}
        return copy

    return {name: None if child is None else build(child, name) for name, child in module._modules.items()}


def with_call_sites(module: nn.Module) -> tuple[nn.Module, dict[int, tuple[str, nn.Module]]]:
    """A shallow copy of ``module`` in which every submodule reachable through containers is a distinct copy per
    attribute path, so a tracer can tell which name each call went through.

    Returns:
        ``(copy, sites)``: ``sites`` maps ``id(site copy)`` to ``(dotted path, original submodule)``.
    """
    sites: dict[int, tuple[str, nn.Module]] = {}

    def site(child: nn.Module, path: str) -> nn.Module:
        copy = shallow_copy(child)
        sites[id(copy)] = (path, child)
        return copy

    root = shallow_copy(module)
    root._modules = stand_ins(module, site)
    return root, sites


def call_sites(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(dotted path, submodule)`` of every call site of ``module`` (the paths :func:`with_call_sites` gives its
    copies), in registration order, without copying anything."""
    sites: list[tuple[str, nn.Module]] = []

    def walk(owner: nn.Module, prefix: str) -> None:
        for name, child in owner._modules.items():
            if child is None:
                continue
            if is_container(child):
                walk(child, f"{prefix}{name}.")
            else:
                sites.append((f"{prefix}{name}", child))

    walk(module, "")
    return sites


def is_structured(module: nn.Module, path: str) -> bool:
    """Whether every proper prefix of ``path`` names a container of ``module`` (so the path can be kept as is)."""
    current = module
    for part in path.split(".")[:-1]:
        current = current._modules.get(part) if current is not None else None
        if current is None or not is_container(current):
            return False
    return True


def assemble(module: nn.Module, wrappers: dict[str, list[nn.Module]],
             unused: Callable[[nn.Module, str], nn.Module], safe_names: bool) -> dict[str, nn.Module | None]:
    """The wrapper hierarchy for ``module``'s submodules: at each attribute path, the wrapper of the call made
    through it (a :class:`MultiplyInvokedModule` for several calls), containers copied around them, and
    ``unused(original submodule, path)`` where no call was made.

    Args:
        module: the original module.
        wrappers: dotted call-site path -> wrappers of its calls, in call order.
        unused: builds what stands at a path never called.
        safe_names: rename top-level names that are reserved (for a CompiledGraphModule; an opaque module's copy
            keeps the names its code reads).

    Returns:
        The ``_modules`` dict for the wrapper (or for the opaque module's copy).
    """

    def build(child: nn.Module, path: str) -> nn.Module:
        if is_container(child):
            copy = shallow_copy(child)
            copy._modules = {name: None if item is None else build(item, f"{path}.{name}")
                             for name, item in child._modules.items()}
            return copy
        calls = wrappers.get(path)
        if not calls:
            return unused(child, path)
        return calls[0] if len(calls) == 1 else MultiplyInvokedModule(calls)

    rename = safe_module_name if safe_names else str
    return {rename(name): None if child is None else build(child, name) for name, child in module._modules.items()}


def wrapper_target(path: str) -> str:
    """Where a call site at ``path`` sits in a CompiledGraphModule (the first component made safe)."""
    first, _, rest = path.partition(".")
    return f"{safe_module_name(first)}.{rest}" if rest else safe_module_name(first)
