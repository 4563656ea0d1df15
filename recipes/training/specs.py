"""Spec dataclasses from YAML: the records each training module's ``interventions`` (or ``deltas``) are made of,
built from mappings and written back as plain data for hyperparameters. No torch, no Lightning."""

from __future__ import annotations

from dataclasses import asdict, fields
from typing import Any, TypeVar

from ..errors import RecipeConfigError

__all__ = ["as_spec", "spec_dict"]

SpecT = TypeVar("SpecT")


def as_spec(cls: type[SpecT], value: Any) -> SpecT:
    """``value`` as a ``cls`` dataclass: returned as is if it already is one, built from it if it is a mapping.

    Raises:
        RecipeConfigError: a mapping with unknown keys, or another type.
    """
    if isinstance(value, cls):
        return value
    if isinstance(value, dict):
        known = {f.name for f in fields(cls)}  # type: ignore[arg-type]
        unknown = sorted(set(value) - known)
        if unknown:
            raise RecipeConfigError(f"unknown {cls.__name__} keys {unknown}; valid keys: {sorted(known)}")
        return cls(**value)
    raise RecipeConfigError(f"expected a {cls.__name__} or a mapping of its fields, got {type(value).__name__}")


def spec_dict(value: Any) -> Any:
    """A dataclass (or a list of them) as plain dicts and lists, for hyperparameters and YAML."""
    if isinstance(value, list):
        return [spec_dict(item) for item in value]
    if hasattr(value, "__dataclass_fields__"):
        return asdict(value)
    return value
