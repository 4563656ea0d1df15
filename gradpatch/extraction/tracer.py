"""A torch.fx tracer whose proxies carry the concrete value computed on the example inputs.

Plain ``torch.fx.symbolic_trace`` cannot follow model code that unpacks shapes (``view(*shape, -1)``), reads
``x.ndim`` or branches on sizes. Here every proxy also holds the real value its node produced on the example
inputs, so such code traces: sizes stay symbolic graph nodes where they feed tensor operations, and Python
branches on sizes are decided by the example (a shape specialisation, as in graphpatch and torch.compile).
Branches on tensor *values* (``if x.sum() > 0``, ``x.item()``) raise
:class:`~gradpatch.errors.DataDependentControlFlow`, and so do changes of grad mode or autocast inside a
forward (a ``torch.no_grad()`` context manager, say) that a graph would silently drop: the caller then falls
back to an opaque module.

Each submodule call is a leaf: :class:`ValueTracer` hands it to a callback that extracts the child's own graph
from the concrete arguments of that call and returns the child's output value.
"""

from __future__ import annotations

import dis
import functools
import operator
from contextlib import contextmanager
from types import CodeType
from typing import Any, Callable, Iterator

import torch
from torch import fx, nn

from .._torch_compat import TreeSpec, tree_flatten, tree_unflatten, untraced_modules
from ..errors import DataDependentControlFlow
from .guards import check_shape_guard
from .variable_names import VariableNamer

#: Tensor attributes whose values are fixed by the example (rank, dtype, device) and are returned concretely.
_STATIC_TENSOR_ATTRIBUTES = frozenset(
    {"dtype", "device", "ndim", "layout", "is_cuda", "is_sparse", "is_quantized", "is_meta", "is_complex",
     "is_floating_point", "dim", "element_size", "is_contiguous", "requires_grad"}
)
#: Tensor methods that move tensor values into Python: the graph could not follow what happens next.
_VALUE_ESCAPING_METHODS = frozenset({"item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__"})

ChildCallback = Callable[["ValueTracer", nn.Module, str, tuple[Any, ...], dict[str, Any]], Any]


class ValueProxy(fx.Proxy):
    """An fx proxy that also knows the value its node produced on the example inputs."""

    @property
    def value(self) -> Any:
        return self.tracer.values[self.node]  # type: ignore[attr-defined]

    def __getattr__(self, name: str) -> Any:
        if name in _STATIC_TENSOR_ATTRIBUTES:
            value = self.value
            if isinstance(value, torch.Tensor):
                return getattr(value, name)
        return super().__getattr__(name)

    def __len__(self) -> int:
        value = self.value
        if isinstance(value, torch.Tensor):  # the first dimension's size, guarded like any size decision
            return self.tracer.concrete_scalar(self.tracer.create_proxy("call_method", "size", (self, 0), {}))
        return len(value)

    def __iter__(self) -> Iterator[Any]:
        return self.tracer.iter(self)

    def __setitem__(self, key: Any, value: Any) -> None:
        # ``outputs[0] = ...`` on a container (or ``x[idx] = ...`` on a tensor): a node that mutates, as the
        # model's code does, so later reads of the container see the new item.
        self.tracer.create_proxy("call_function", operator.setitem, (self, key, value), {})

    def __int__(self) -> int:
        return int(self.tracer.concrete_scalar(self))

    def __index__(self) -> int:
        return operator.index(self.tracer.concrete_scalar(self))

    def __float__(self) -> float:
        return float(self.tracer.concrete_scalar(self))

    def __repr__(self) -> str:
        return f"ValueProxy({self.node.name})"


class ValueTracer(fx.Tracer):
    """Traces one module's forward into an fx graph, computing every node's value on the example inputs.

    Args:
        on_child_call: ``(tracer, module, qualified_name, args, kwargs) -> output proxy``, called for every
            submodule call; it emits the call node (:meth:`create_proxy_with_value`) and returns its proxy.
    """

    def __init__(self, on_child_call: ChildCallback) -> None:
        super().__init__(autowrap_modules=(), param_shapes_constant=False)
        self.proxy_buffer_attributes = True
        self.values: dict[fx.Node, Any] = {}
        #: (node, example value) for each Python decision made on a size during tracing.
        self.guards: list[tuple[fx.Node, Any]] = []
        self._on_child_call = on_child_call
        self._placeholders: list[tuple[str, Any]] = []
        self._call: Callable[[list[ValueProxy]], Any] | None = None
        self._grad_enabled = True
        self._autocast_state: tuple[bool, ...] = ()
        #: The traced call's return value on the example inputs (containers rebuilt, proxies replaced by values).
        self.output_value: Any = None
        self._namer: VariableNamer | None = None

    def trace_call(
        self,
        root: nn.Module,
        placeholders: list[tuple[str, Any]],
        call: Callable[[list[ValueProxy]], Any],
    ) -> fx.Graph:
        """Trace ``call`` with placeholder proxies; returns the graph (values in :attr:`values`).

        Args:
            root: the module whose parameters and buffers the graph reads (``get_attr`` nodes).
            placeholders: ``(name, example value)`` for the graph inputs, in order (``**name`` for a catch-all).
            call: ``(placeholder proxies) -> output``; runs the module's forward with the proxies in place.
        """
        self._placeholders = placeholders
        self._call = call
        self._grad_enabled = torch.is_grad_enabled()
        self._autocast_state = _autocast_state()
        return self.trace(root)

    # --- fx.Tracer hooks -------------------------------------------------------------------------------------

    def create_args_for_root(self, root_fn: Any, is_module: bool, concrete_args: Any = None) -> tuple[Any, list]:
        # Every named input defaults to None: compiled parents pass only tensor-holding arguments, and constants
        # are baked into the graph, so callers keep the original calling convention.
        proxies = [
            self.create_proxy("placeholder", name, () if name.startswith("*") else (None,), {})
            for name, _ in self._placeholders
        ]
        for proxy, (_, value) in zip(proxies, self._placeholders):
            self.values[proxy.node] = value
        call = self._call
        assert call is not None

        def run(*_):  # type: ignore[no-untyped-def]  # no annotation: fx would copy it into the code
            output = call(proxies)
            namer.finish()
            self.output_value = self.value_of(output)
            return self._lower_output(output)

        namer = self._namer = VariableNamer(self.graph, run.__code__)

        return run, []

    def proxy(self, node: fx.Node) -> ValueProxy:
        return ValueProxy(node, self)

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return True

    def call_module(self, m: nn.Module, forward: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        try:
            qualified_name = self.path_of_module(m)
        except NameError:
            return forward(*args, **kwargs)  # a module outside the hierarchy: trace through its code
        return self._on_child_call(self, m, qualified_name, args, kwargs)

    def create_arg(self, a: Any) -> Any:
        if isinstance(a, fx.Proxy):
            return a.node
        return super().create_arg(a)

    def create_proxy(self, kind: str, target: Any, args: tuple, kwargs: dict, name: str | None = None,
                     type_expr: Any = None, proxy_factory_fn: Any = None) -> ValueProxy:
        if kind == "placeholder":
            return super().create_proxy(kind, target, args, kwargs, name, type_expr, proxy_factory_fn)
        self._check_global_state(target)
        if kind == "call_method" and target in _VALUE_ESCAPING_METHODS:
            raise DataDependentControlFlow(f"'.{target}()' moves a tensor value into Python control flow")
        value = self._evaluate(kind, target, args, kwargs)
        return self._record(super().create_proxy(kind, target, args, kwargs, name, type_expr, proxy_factory_fn), value)

    def create_proxy_with_value(self, kind: str, target: Any, args: tuple, kwargs: dict, value: Any) -> ValueProxy:
        """Emit a node whose value is already known (a submodule call extracted separately)."""
        self._check_global_state(target)
        return self._record(super().create_proxy(kind, target, args, kwargs), value)

    def _record(self, proxy: ValueProxy, value: Any) -> ValueProxy:
        """Keep a new node's value; name the nodes stored in variables since the previous one."""
        self.values[proxy.node] = value
        if self._namer is not None:
            self._namer.scan()
            self._namer.created(proxy.node)
        return proxy

    def to_bool(self, obj: fx.Proxy) -> bool:
        return bool(self.concrete_scalar(obj))

    def insert_guards(self) -> None:
        """After each node the trace decided on, check at run time that it still has its example value (the
        check names the node; its module's path is found when it fails, so that repeated modules share graphs)."""
        for node, value in self.guards:
            with self.graph.inserting_after(node):
                self.graph.call_function(check_shape_guard, (node, value, node.name))

    def iter(self, obj: fx.Proxy) -> Iterator[Any]:
        value = self.values[obj.node]
        if isinstance(value, dict):
            return iter(value.keys())
        return iter([obj[index] for index in range(len(obj))])

    def keys(self, obj: fx.Proxy) -> Any:
        return self.values[obj.node].keys()

    # --- helpers ---------------------------------------------------------------------------------------------

    def concrete_scalar(self, obj: fx.Proxy) -> Any:
        """The example value of a Python-scalar proxy (a size, a flag), recorded as a guard; tensors raise."""
        value = self.values[obj.node]
        if isinstance(value, torch.Tensor):
            raise DataDependentControlFlow(
                f"Python control flow on the value of tensor {obj.node.name} (e.g. 'if x.sum() > 0')"
            )
        self.guards.append((obj.node, value))
        return value

    def value_of(self, argument: Any) -> Any:
        """Replace every proxy inside ``argument`` (nested containers too) by its example value."""
        return map_proxies(argument, lambda proxy: self.values[proxy.node])

    def _evaluate(self, kind: str, target: Any, args: tuple, kwargs: dict) -> Any:
        if kind == "get_attr":
            return resolve_attribute(self.root, target)
        args, kwargs = self.value_of(args), self.value_of(kwargs)
        if kind == "call_function":
            return target(*args, **kwargs)
        if kind == "call_method":
            return getattr(args[0], target)(*args[1:], **kwargs)
        raise AssertionError(f"unexpected node kind {kind}: submodule calls go through create_proxy_with_value")

    def _check_global_state(self, target: Any) -> None:
        if torch.is_grad_enabled() != self._grad_enabled or _autocast_state() != self._autocast_state:
            raise DataDependentControlFlow(
                f"the forward changes grad mode or autocast (a context manager or decorator such as "
                f"torch.no_grad()) around {getattr(target, '__name__', target)}; a graph would drop it"
            )

    def _lower_output(self, output: Any) -> Any:
        """Return values that fx cannot store as constants (ModelOutput dataclasses) are rebuilt by a node."""
        if isinstance(output, (fx.Proxy, tuple, list)) or type(output) is dict or output is None:
            return output
        leaves, spec = tree_flatten(output)
        if spec.is_leaf():
            return output
        return self.create_proxy("call_function", OutputRebuilder(spec), (list(leaves),), {}, name="output_value")


class OutputRebuilder:
    """Rebuilds a pytree return value (e.g. a transformers ``ModelOutput``) from its leaves in generated code."""

    def __init__(self, spec: TreeSpec) -> None:
        self.spec = spec
        self.__name__ = "rebuild_output"  # fx names the generated global after this

    def __call__(self, leaves: list[Any]) -> Any:
        return tree_unflatten(leaves, self.spec)


def map_proxies(argument: Any, fn: Callable[[fx.Proxy], Any]) -> Any:
    """``argument`` (a proxy, or tuples / lists / dicts / slices holding proxies) with every torch.fx proxy replaced
    by ``fn(proxy)``; other values as they are."""
    if isinstance(argument, fx.Proxy):
        return fn(argument)
    if isinstance(argument, (tuple, list)):
        mapped = [map_proxies(item, fn) for item in argument]
        if isinstance(argument, tuple) and hasattr(argument, "_fields"):
            return type(argument)(*mapped)
        return type(argument)(mapped)
    if isinstance(argument, dict):
        return type(argument)((key, map_proxies(item, fn)) for key, item in argument.items())
    if isinstance(argument, slice):
        return slice(*(map_proxies(part, fn) for part in (argument.start, argument.stop, argument.step)))
    return argument


@contextmanager
def concrete_execution() -> Iterator[None]:
    """Run real module code inside a trace, outside the patches of every active tracer."""
    with untraced_modules():
        yield


def check_traceable(function: Any) -> None:
    """Raise :class:`DataDependentControlFlow` for a forward that calls ``torch._dynamo.graph_break()``: it asks
    graph compilers not to capture it whole, so it stays opaque (its submodules still get graphs)."""
    code = getattr(function, "__code__", None)
    if code is None:
        return
    names = getattr(function, "__globals__", {})
    for opname in _graph_break_loads(code):
        if opname != "LOAD_GLOBAL" or _is_graph_break(names.get("graph_break")):
            raise DataDependentControlFlow("the forward calls torch._dynamo.graph_break(), which asks graph "
                                           "compilers not to capture it as one graph")


@functools.lru_cache(maxsize=4096)
def _graph_break_loads(code: CodeType) -> tuple[str, ...]:
    """The opcodes of ``code``'s instructions naming ``graph_break`` (disassembled once per code object)."""
    return tuple(instruction.opname for instruction in dis.get_instructions(code)
                 if instruction.argval == "graph_break")


def _is_graph_break(value: Any) -> bool:
    return getattr(value, "__name__", "") == "graph_break" and getattr(value, "__module__", "").startswith("torch")


def resolve_attribute(root: nn.Module, target: str) -> Any:
    """The parameter, buffer, submodule or plain attribute at dotted ``target``, without ``__getattr__`` hooks."""
    obj: Any = root
    for part in target.split("."):
        state = _instance_dict(obj)
        for registry in ("_parameters", "_buffers", "_modules"):
            entries = state.get(registry, {})
            if part in entries:
                obj = entries[part]
                break
        else:
            obj = state[part] if part in state else getattr(obj, part)
    return obj


def _instance_dict(obj: Any) -> dict[str, Any]:
    """``obj.__dict__`` read past any ``__getattribute__`` of its class (attribute reads are recorded while a
    module traces, :mod:`gradpatch.extraction.reuse`; this read is the tracer's own); ``{}`` without one."""
    try:
        return object.__getattribute__(obj, "__dict__")
    except AttributeError:
        return {}


def depends_on_input_values(node: fx.Node) -> bool:
    """Whether the value of ``node`` may depend on the *values* of the graph's inputs or of module tensors, rather
    than only on input sizes and constants (``torch.arange(x.shape[1])`` depends on sizes only)."""
    seen: set[fx.Node] = set()
    pending = [node]
    while pending:
        current = pending.pop()
        if current in seen:
            continue
        seen.add(current)
        if current.op in ("placeholder", "get_attr", "call_module"):
            return True
        if _reads_size_only(current):
            continue
        pending.extend(current.all_input_nodes)
    return False


def _reads_size_only(node: fx.Node) -> bool:
    if node.op == "call_function" and node.target is getattr:
        return node.args[1] in ("shape", "ndim", "dtype", "device")
    return node.op == "call_method" and node.target in ("size", "dim")


def contains_proxy(argument: Any) -> bool:
    """Whether a (possibly nested) argument holds any proxy."""
    found = False

    def mark(proxy: fx.Proxy) -> None:
        nonlocal found
        found = True

    map_proxies(argument, mark)
    return found


def _autocast_state() -> tuple[bool, ...]:
    return tuple(torch.is_autocast_enabled(device) for device in ("cpu", "cuda"))
