"""How a module call's arguments become graph inputs (placeholders) and how the traced call is replayed."""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Any

from torch import nn

from ..value_info import holds_input


@dataclass
class InputPlan:
    """How the example call's arguments map to graph placeholders.

    Attributes:
        bound: the example call bound to the module's ``forward`` (``self`` first), defaults applied.
        placeholders: ``(placeholder target, example value)`` per parameter, in signature order: ``*args`` as
            one ``*name`` placeholder holding a tuple, ``**kwargs`` as one ``**name`` placeholder holding a dict.
        dynamic: the placeholder targets whose example values hold tensors (graph inputs); the others are
            constants baked into the graph (their placeholders keep the calling convention).
    """

    bound: inspect.BoundArguments
    placeholders: list[tuple[str, Any]]
    dynamic: set[str]


def plan_inputs(module: nn.Module, args: tuple, kwargs: dict) -> InputPlan:
    """Bind the example call to ``type(module).forward`` and decide one placeholder per parameter."""
    forward = type(module).forward
    try:
        signature = _signature(forward)
    except TypeError:  # an unhashable callable
        signature = inspect.signature(forward)
    bound = signature.bind(module, *args, **kwargs)
    bound.apply_defaults()
    placeholders: list[tuple[str, Any]] = []
    for parameter in list(signature.parameters.values())[1:]:
        value = bound.arguments.get(parameter.name)
        if parameter.kind is inspect.Parameter.VAR_POSITIONAL:
            placeholders.append((f"*{parameter.name}", tuple(value or ())))
        elif parameter.kind is inspect.Parameter.VAR_KEYWORD:
            placeholders.append((f"**{parameter.name}", dict(value or {})))
        else:
            placeholders.append((parameter.name, value))
    dynamic = {target for target, value in placeholders if holds_input(value)}
    return InputPlan(bound=bound, placeholders=placeholders, dynamic=dynamic)


@functools.lru_cache(maxsize=1024)
def _signature(function: Any) -> inspect.Signature:
    """``inspect.signature`` of a ``forward`` function, computed once per function (signatures are immutable)."""
    return inspect.signature(function)


def substitute(plan: InputPlan, proxies: dict[str, Any]) -> tuple[list[Any], dict[str, Any]]:
    """The example call (``self`` dropped) as ``(args, kwargs)`` with graph inputs replaced by placeholder proxies.

    Items of ``*args`` and ``**kwargs`` that hold tensors are read from their placeholder (``args[i]``,
    ``kwargs[key]``); the others are the example's constants. Arguments go by keyword except positional-only
    ones and those before a non-empty ``*args``.
    """
    parameters = list(plan.bound.signature.parameters.values())[1:]
    arguments = plan.bound.arguments
    var_positional = next((p for p in parameters if p.kind is inspect.Parameter.VAR_POSITIONAL), None)
    positional_until = parameters.index(var_positional) if var_positional and arguments.get(var_positional.name) else 0
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    for index, parameter in enumerate(parameters):
        name = parameter.name
        value = arguments[name]
        if parameter.kind is inspect.Parameter.VAR_POSITIONAL:
            items = proxies[f"*{name}"]
            args.extend(items[i] if holds_input(item) else item for i, item in enumerate(value))
        elif parameter.kind is inspect.Parameter.VAR_KEYWORD:
            items = proxies[f"**{name}"]
            kwargs.update({key: items[key] if holds_input(item) else item for key, item in value.items()})
        else:
            value = proxies[name] if name in plan.dynamic else value
            if parameter.kind is inspect.Parameter.POSITIONAL_ONLY or index < positional_until:
                args.append(value)
            else:
                kwargs[name] = value
    return args, kwargs
