"""Every attribution method by its command-line name."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..patchable_graph import PatchableGraph
from .atp import atp
from .atp_star import atp_star
from .edges import eap
from .errors import AttributionError
from .exact import exact_sweep
from .metrics import Metric, logit_difference
from .nodes import Node
from .prompts import PromptBatch
from .records import AttributionResult
from .runner import Progress

__all__ = ["METHODS", "run_method"]

#: The methods :func:`run_method` runs.
METHODS = ("exact", "atp", "atp-ig", "atp-star", "eap", "eap-ig")


def run_method(method: str, pg: PatchableGraph, batch: PromptBatch, nodes: Sequence[Node] | str,
               metric: Metric = logit_difference, *, direction: str = "noise", batch_size: int = 32, steps: int = 5,
               grad_drop: bool = False, forward_kwargs: Mapping[str, Any] | None = None,
               progress: Progress | None = None) -> AttributionResult:
    """Run attribution method ``method`` (one of :data:`METHODS`); the edge methods (``eap``, ``eap-ig``) score
    edges and ignore ``nodes``.

    Args:
        batch_size: rows per forward pass of batched exact patching.
        steps: interpolation steps of AtP-IG and EAP-IG.
        grad_drop: AtP* with GradDrop (magnitudes).
        (the others): as for :func:`~gradpatch.attribution.exact.exact_sweep`.

    Raises:
        AttributionError: an unknown method, and what the method raises for bad input.
    """
    if method == "exact":
        return exact_sweep(pg, batch, nodes, metric, direction=direction, batch_size=batch_size,
                           forward_kwargs=forward_kwargs, progress=progress)
    if method in ("atp", "atp-ig"):
        if method == "atp-ig" and steps < 1:
            raise AttributionError(f"atp-ig needs at least 1 interpolation step, got steps={steps}")
        return atp(pg, batch, nodes, metric, direction=direction, steps=steps if method == "atp-ig" else 0,
                   forward_kwargs=forward_kwargs)
    if method == "atp-star":
        return atp_star(pg, batch, nodes, metric, direction=direction, grad_drop=grad_drop,
                        forward_kwargs=forward_kwargs)
    if method in ("eap", "eap-ig"):
        if method == "eap-ig" and steps < 1:
            raise AttributionError(f"eap-ig needs at least 1 interpolation step, got steps={steps}")
        return eap(pg, batch, metric, steps=steps if method == "eap-ig" else 0, direction=direction,
                   batch_size=batch_size, forward_kwargs=forward_kwargs, progress=progress)
    raise AttributionError(f"method {method!r} is not implemented; choose one of {', '.join(METHODS)}")
