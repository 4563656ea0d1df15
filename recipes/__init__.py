"""gradpatch recipes: Lightning modules, TensorBoard logging, YAML configs and the ``gradpatch`` command line.

- :class:`DeltaModule`: learn AddPatch deltas (an :class:`gradpatch.Intervention`) at NodePaths of a frozen model,
  for target continuations, steering towards/away from tokens, with KL and L2 regularisers.
- :class:`ObjectiveModule`: optimise tensors against any objective callable (the extension point for ROME's value
  step).
- :class:`InterventionLogger`: TensorBoard scalars, histograms, generations and hyperparameters.
- :class:`DeviceMapStrategy`: train on a model spread over devices by accelerate (``device_map="auto"``).
- ``gradpatch fit --config recipes/configs/steer_eiffel.yaml`` (:mod:`recipes.fit_cli`) and ``gradpatch graph``
  (:mod:`recipes.cli`).

The names are imported lazily, so ``recipes.cli`` (the ``gradpatch`` command) works without Lightning; the Lightning
parts need ``pip install 'gradpatch[recipes]'`` (Lightning, TensorBoard, jsonargparse[signatures]).
"""

from __future__ import annotations

import importlib
from typing import Any

#: Public name -> submodule that defines it.
_EXPORTS: dict[str, str] = {
    "DeltaModule": "delta_module",
    "DeltaSpec": "specs",
    "DeviceMapStrategy": "strategies",
    "FrozenGraphModule": "frozen",
    "InterventionLogger": "logger",
    "Objective": "specs",
    "ObjectiveModule": "objective_module",
    "RecipeConfigError": "errors",
    "RecipeError": "errors",
    "Row": "data",
    "TargetSpec": "specs",
    "build_rows": "data",
    "collate_rows": "data",
    "greedy_generate": "generation",
    "left_pad": "data",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    """Import public names on first use (PEP 562).

    Raises:
        AttributeError: an unknown name.
        ImportError: Lightning is missing (the message names ``pip install 'gradpatch[recipes]'``).
    """
    if name not in _EXPORTS:
        raise AttributeError(f"module 'recipes' has no attribute {name!r}")
    try:
        module = importlib.import_module(f".{_EXPORTS[name]}", __name__)
    except ModuleNotFoundError as exc:
        if exc.name in ("lightning", "tensorboard", "jsonargparse"):
            raise ImportError(f"recipes.{name} needs {exc.name}: pip install 'gradpatch[recipes]'") from exc
        raise
    return getattr(module, name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
