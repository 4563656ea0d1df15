"""accelerate, when installed: its module hooks (``device_map`` dispatch, CPU and disk offload) and
``align_module_device`` (an offloaded module's weights loaded for a block of code).

``AVAILABLE`` says whether ``accelerate`` imported. Without it, ``ModelHook`` is an empty stand-in class and the
hook functions do nothing, so code that checks for hooks runs unchanged on models accelerate never touched.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

try:
    from accelerate.hooks import ModelHook, add_hook_to_module, remove_hook_from_module
    from accelerate.utils import align_module_device

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

    @contextlib.contextmanager
    def align_module_device(module: Any, execution_device: Any = None) -> Iterator[None]:  # type: ignore[misc]
        """Stand-in: accelerate is not installed, so no weight is offloaded; does nothing."""
        yield


__all__ = ["AVAILABLE", "ModelHook", "add_hook_to_module", "align_module_device", "remove_hook_from_module"]
