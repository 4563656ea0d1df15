"""accelerate, when installed: its module hooks (``device_map`` dispatch, CPU and disk offload).

``AVAILABLE`` says whether ``accelerate`` imported. Without it, ``ModelHook`` is an empty stand-in class and the
hook functions do nothing, so code that checks for hooks runs unchanged on models accelerate never touched.
"""

from __future__ import annotations

from typing import Any

try:
    from accelerate.hooks import ModelHook, add_hook_to_module, remove_hook_from_module

    AVAILABLE = True
except ImportError:  # pragma: no cover - depends on the environment
    AVAILABLE = False

    class ModelHook:  # type: ignore[no-redef]
        """Stand-in: accelerate is not installed."""

    def add_hook_to_module(module: Any, hook: Any, append: bool = False) -> Any:  # type: ignore[misc]
        """Stand-in: accelerate is not installed; returns ``module`` unchanged."""
        return module

    def remove_hook_from_module(module: Any, recurse: bool = False) -> Any:  # type: ignore[misc]
        """Stand-in: accelerate is not installed; returns ``module`` unchanged."""
        return module


__all__ = ["AVAILABLE", "ModelHook", "add_hook_to_module", "remove_hook_from_module"]
