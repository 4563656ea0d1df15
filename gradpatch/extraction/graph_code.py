"""The code ``pg.graph._code`` shows for a compiled graph: its generated code under the forward's own signature.

The generated function gives every input a ``None`` default (compiled parents pass only tensor arguments; constants
are baked in), so its own ``def`` line (``def forward(self, x = None):``) is not how the module is called. The
shown code keeps the generated body and replaces that line with the original ``forward``'s parameters: their
annotations (a tensor input without one is shown as ``torch.Tensor``, as graphpatch's torch.compile graphs showed
it), their defaults, ``*args``/``**kwargs`` and the ``/`` and ``*`` markers, and the return annotation, written as
torch.fx writes them (``x : torch.Tensor``).
"""

from __future__ import annotations

import inspect
import typing
from typing import Any, Callable

from torch import fx

#: ``ValueInfo.kind`` of a tensor example value.
_TENSOR = "Tensor"


def graph_code(module: fx.GraphModule, forward: Callable[..., Any] | None) -> str:
    """``module.code`` without its surrounding blank lines, its ``def forward`` line showing ``forward``'s signature.

    Args:
        module: a graph whose placeholders carry ``meta["gp_info"]`` (the example value's description).
        forward: the original module's ``forward`` (unbound, ``self`` first); ``None`` keeps the generated line.

    Returns:
        The code, e.g. ``"def forward(self, x : torch.Tensor):\\n    linear = self.linear(x);  x = None\\n..."``.
    """
    lines = module.code.strip("\n").rstrip().splitlines()
    header = next((index for index, line in enumerate(lines) if line.startswith("def forward(")), None)
    if forward is None or header is None:
        return "\n".join(lines)
    try:
        signature = inspect.signature(forward)
    except (TypeError, ValueError):
        return "\n".join(lines)
    tensors = {str(node.target).lstrip("*") for node in module.graph.nodes
               if node.op == "placeholder" and getattr(node.meta.get("gp_info"), "kind", None) == _TENSOR}
    lines[header] = f"def forward({format_parameters(signature, tensors)}){format_return(signature)}:"
    return "\n".join(lines)


def format_parameters(signature: inspect.Signature, tensors: set[str]) -> str:
    """The parameter list of ``signature`` in torch.fx's style (``self, x : torch.Tensor, blah : int = 3``).

    Args:
        signature: the forward's signature, ``self`` first.
        tensors: names of parameters whose example value was a tensor (annotated ``torch.Tensor`` when the forward
            does not annotate them).
    """
    parts: list[str] = []
    parameters = list(signature.parameters.values())
    for index, parameter in enumerate(parameters):
        kind = parameter.kind
        if kind is inspect.Parameter.KEYWORD_ONLY and not any(
                p.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.KEYWORD_ONLY) for p in parameters[:index]):
            parts.append("*")
        prefix = {inspect.Parameter.VAR_POSITIONAL: "*", inspect.Parameter.VAR_KEYWORD: "**"}.get(kind, "")
        text = prefix + parameter.name
        annotation = _annotation(parameter.annotation)
        if not annotation and index > 0 and parameter.name in tensors and not prefix:
            annotation = "torch.Tensor"
        if annotation:
            text += f" : {annotation}"
        if parameter.default is not inspect.Parameter.empty:
            text += f" = {parameter.default!r}"
        parts.append(text)
        if kind is inspect.Parameter.POSITIONAL_ONLY and (
                index + 1 == len(parameters) or parameters[index + 1].kind is not inspect.Parameter.POSITIONAL_ONLY):
            parts.append("/")
    return ", ".join(parts)


def format_return(signature: inspect.Signature) -> str:
    """`` -> annotation`` when the forward annotates its return value, else ``""``."""
    annotation = _annotation(signature.return_annotation)
    return f" -> {annotation}" if annotation else ""


def _annotation(annotation: Any) -> str:
    if annotation is inspect.Parameter.empty or annotation is inspect.Signature.empty:
        return ""
    if isinstance(annotation, str):  # postponed evaluation (``from __future__ import annotations``)
        return annotation
    if typing.get_origin(annotation) is getattr(typing, "Unpack", None):  # ``**kwargs: Unpack[TypedDict]``
        return f"Unpack[{', '.join(_annotation(argument) for argument in typing.get_args(annotation))}]"
    return inspect.formatannotation(annotation)
