"""accelerate dispatch: models loaded with a ``device_map`` (layers on several devices, offloaded to CPU or disk).

accelerate wraps each dispatched module's ``forward`` with a hook whose ``pre_forward`` moves the inputs to the
module's execution device and, for offloaded modules, loads the weights (replacing the meta placeholders in the
module's parameter registry), and whose ``post_forward`` offloads them again. Graphs run the module's class
``forward``, so a wrapper of a hooked module runs the hook itself (:class:`Dispatch`) and re-reads the tensors
of its subtree after each hook event: the graph computes on the weights accelerate loaded, and no wrapper keeps
an offloaded weight alive.

Nothing here imports accelerate: a hook is whatever accelerate stores as ``module._hf_hook``.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any, Callable

import torch
from torch import nn


def accelerate_hook(module: nn.Module) -> Any:
    """The accelerate hook attached to ``module`` (``module._hf_hook``), or ``None``."""
    return module.__dict__.get("_hf_hook")


def execution_device(module: nn.Module) -> torch.device | None:
    """The device accelerate runs ``module`` on (its hook's ``execution_device``: where an offloaded module's weights
    are loaded for a call), or ``None`` if it has no hook or the hook names none."""
    device = getattr(accelerate_hook(module), "execution_device", None)
    return None if device is None else torch.device(device)


def run_hooked(module: nn.Module, hook: Any, args: tuple, kwargs: dict,
               forward: Callable[[tuple, dict], Any]) -> Any:
    """Run ``forward(args, kwargs)`` between ``hook.pre_forward`` and ``hook.post_forward`` on ``module``, as
    accelerate's own forward wrapper does (under ``no_grad`` if the hook asks for it). If ``forward`` raises (a
    probe that stops the pass early, say), an offloading hook's ``post_forward`` still runs, so the weights it
    loaded go back to their placeholders."""
    args, kwargs = hook.pre_forward(module, *args, **kwargs)
    try:
        with torch.no_grad() if getattr(hook, "no_grad", False) else nullcontext():
            output = forward(args, kwargs)
    except BaseException:
        if offloads(hook):
            hook.post_forward(module, None)
        raise
    return hook.post_forward(module, output)


def offloads(hook: Any) -> bool:
    """Whether an accelerate hook (or one of a ``SequentialHook``'s) loads and offloads weights around calls."""
    return any(getattr(part, "offload", False) for part in getattr(hook, "hooks", (hook,)))


class Dispatch:
    """Runs the accelerate hook of ``source`` around its wrapper's forward.

    Args:
        source: the original module carrying the hook.
        hook: its accelerate hook.
        wrapper: the wrapper of ``source``; every wrapper below it re-reads its tensors after each hook event.
    """

    def __init__(self, source: nn.Module, hook: Any, wrapper: nn.Module) -> None:
        self.source = source
        self.hook = hook
        # Only offloading hooks swap tensors; the wrappers below are fixed once this one is built.
        self._refreshed = [module for module in wrapper.modules() if hasattr(module, "refresh_tensors")] \
            if offloads(hook) else []

    def wrap(self, forward: Callable[..., Any]) -> Callable[..., Any]:
        """A forward function (``forward(wrapper, *args, **kwargs)``) that runs ``forward`` inside the hook."""

        def dispatched(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
            def run(args: tuple, kwargs: dict) -> Any:
                self.refresh()
                return forward(module, *args, **kwargs)

            try:
                return run_hooked(self.source, self.hook, args, kwargs, run)
            finally:
                self.refresh()

        return dispatched

    def refresh(self) -> None:
        """Point every wrapper below (and including) this one at its original module's current tensors."""
        for module in self._refreshed:
            module.refresh_tensors()
