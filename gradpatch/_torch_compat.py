"""Every private torch name the engine uses, each behind a named function.

torch gives no stability promise for these names; graphpatch stopped importing on torch 2.6 because of them.
When a torch upgrade removes or changes one, the function here is the one place to mend, and
``tests/engine/test_torch_compat.py`` names the symbol that disappeared. The list, with what each is for, is in
docs/engine.md ("Private torch names").
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
from torch import fx, nn
from torch.fx import _symbolic_trace
from torch.fx import graph_module as _graph_module
from torch.utils import _pytree

#: The installed torch release as ``(major, minor, patch)``, e.g. ``(2, 13, 0)``.
TORCH_VERSION: tuple[int, ...] = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:3])

#: Each private torch name used below -> a function that fetches it (tests/engine/test_torch_compat.py calls them all).
PRIVATE_SYMBOLS: dict[str, Callable[[], Any]] = {
    "torch.fx.graph_module._forward_from_src": lambda: _graph_module._forward_from_src,
    "torch.fx._symbolic_trace._maybe_revert_all_patches": lambda: _symbolic_trace._maybe_revert_all_patches,
    "torch.fx._symbolic_trace._orig_module_call": lambda: _symbolic_trace._orig_module_call,
    "torch.fx._symbolic_trace._orig_module_getattr": lambda: _symbolic_trace._orig_module_getattr,
    "torch.fx.Graph._graph_namespace._rename_object": lambda: fx.Graph()._graph_namespace._rename_object,
    "torch.fx.graph.PythonCode._lineno_map": lambda: fx.Graph().python_code(root_module="self")._lineno_map,
    "torch.fx.graph.PythonCode._prologue_start": lambda: fx.Graph().python_code(root_module="self")._prologue_start,
    "torch.utils._pytree.tree_flatten": lambda: _pytree.tree_flatten,
    "torch.utils._pytree.tree_unflatten": lambda: _pytree.tree_unflatten,
    "torch.utils._pytree.TreeSpec": lambda: _pytree.TreeSpec,
    "torch._dynamo.exc.Unsupported": lambda: dynamo_unsupported_error(),
    "torch._dynamo.exc.TorchDynamoException": lambda: dynamo_error(),
    "torch._grouped_mm": lambda: grouped_mm_kernel(),
}

#: A pytree's structure (``torch.utils._pytree.TreeSpec``).
TreeSpec = _pytree.TreeSpec


def dynamo_unsupported_error() -> type[Exception]:
    """The exception ``torch.compile`` raises for code dynamo cannot trace (``torch._dynamo.exc.Unsupported``)."""
    from torch._dynamo import exc

    return exc.Unsupported


def dynamo_error() -> type[Exception]:
    """The base class of every error dynamo raises while compiling (``torch._dynamo.exc.TorchDynamoException``):
    ``Unsupported``, ``TorchRuntimeError`` (an op failed on fake tensors), ``BackendCompilerFailed``, ..."""
    from torch._dynamo import exc

    return exc.TorchDynamoException


def grouped_mm_kernel() -> Callable[..., torch.Tensor]:
    """``torch._grouped_mm``: the grouped matrix multiply behind transformers' mixture-of-experts layers."""
    return torch._grouped_mm


def grouped_mm_functions() -> tuple[Callable[..., torch.Tensor], ...]:
    """The functions a traced graph may call for a grouped matrix multiply: ``torch._grouped_mm`` and, where torch
    has it, ``torch.nn.functional.grouped_mm``; none on a torch without them."""
    names = [(torch, "_grouped_mm"), (torch.nn.functional, "grouped_mm")]
    return tuple(getattr(owner, name) for owner, name in names if hasattr(owner, name))


def forward_from_graph(graph: fx.Graph) -> Callable[..., Any]:
    """Generate and compile the forward function of ``graph`` (``self`` as the module argument)."""
    code = graph.python_code(root_module="self")
    return _graph_module._forward_from_src(code.src, code.globals, None)


def compile_graph_code(module: fx.GraphModule) -> tuple[Any, Callable[..., Any]]:
    """Generate ``module.graph``'s code, record it on ``module`` as ``GraphModule.recompile`` does (``.code`` and
    the line map behind error messages), and compile it.

    Returns:
        ``(python_code, forward_function)``.
    """
    graph = module.graph
    code = graph.python_code(root_module="self")
    module._code = code.src
    module._lineno_map = code._lineno_map
    module._prologue_start = code._prologue_start
    forward = _graph_module._forward_from_src(code.src, code.globals, getattr(graph, "_co_fields", {}))
    return code, forward


@contextmanager
def untraced_modules() -> Iterator[None]:
    """Undo every active fx tracer's patches of ``nn.Module.__call__`` and ``__getattr__`` for the block.

    Nested traces (a module traced while its parent is traced) stack their patches; fx's own revert undoes only
    the innermost tracer's.
    """
    patched = (nn.Module.__call__, nn.Module.__getattr__)
    try:
        with _symbolic_trace._maybe_revert_all_patches():
            nn.Module.__call__ = _symbolic_trace._orig_module_call  # type: ignore[method-assign]
            nn.Module.__getattr__ = _symbolic_trace._orig_module_getattr  # type: ignore[method-assign]
            yield
    finally:
        nn.Module.__call__, nn.Module.__getattr__ = patched  # type: ignore[method-assign]


def set_node_name(node: fx.Node, name: str) -> None:
    """Name ``node`` exactly ``name`` (the caller keeps names unique in the graph) and record it in the graph's
    namespace, so nodes added later get other names."""
    node.name = name
    node.graph._graph_namespace._rename_object(node, name)


def tree_flatten(value: Any) -> tuple[list[Any], TreeSpec]:
    """Leaves and structure of a nested value (tuples, lists, dicts, dataclasses such as ``ModelOutput``)."""
    return _pytree.tree_flatten(value)


def tree_unflatten(leaves: list[Any], spec: TreeSpec) -> Any:
    """Inverse of :func:`tree_flatten`."""
    return _pytree.tree_unflatten(leaves, spec)
