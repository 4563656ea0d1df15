"""The attributes of a module that an opaque wrapper exposes as patchable nodes.

Like graphpatch: the module's parameters, buffers and plain attributes (``in_features``, ``scaling``, class
variables such as ``__constants__``), but not nn.Module's own machinery, properties, methods, other callables or
submodules. transformers' ``PreTrainedModel`` bookkeeping (``config``, ``name_or_path``...) is left out too.
"""

from __future__ import annotations

import inspect
import sys
from typing import Any

from torch import nn

from .hierarchy import leaf_node_name

_MODULE_NAMESPACE = frozenset(dir(nn.Module)) | frozenset(getattr(nn.Module, "__annotations__", {})) | {
    "_modules", "_parameters", "_buffers", "__class__", "__dict__", "__weakref__", "__slotnames__",
    "_hf_hook", "_old_forward", "_is_hf_initialized",
}
#: Attributes left out for some classes, to show them as graphpatch does (LayerNorm as weight, bias, eps and
#: normalized_shape).
_HIDDEN_BY_CLASS: dict[type[nn.Module], frozenset[str]] = {nn.LayerNorm: frozenset({"__constants__",
                                                                                   "elementwise_affine"})}
#: transformers' PreTrainedModel attributes that are configuration, not activations.
_TRANSFORMERS_ATTRIBUTES = frozenset({
    "config", "device", "dtype", "generation_config", "hf_device_map", "is_loaded_in_8bit", "is_loaded_in_4bit",
    "name_or_path", "warnings_issued", "_hf_peft_config_loaded", "hf_quantizer", "is_8bit_serializable",
    "is_quantized", "quantization_method",
})


def patchable_attributes(module: nn.Module) -> dict[str, str]:
    """NodePath name -> attribute name, sorted by attribute name, for ``module``'s patchable attributes.

    Args:
        module: the original module (properties are never evaluated).
    """
    skipped = _MODULE_NAMESPACE | _pretrained_namespace(module) | _HIDDEN_BY_CLASS.get(type(module), frozenset())
    names = set(dir(type(module))) | set(module.__dict__) | set(module._parameters) | set(module._buffers)
    result: dict[str, str] = {}
    for name in sorted(names - skipped):
        if name.startswith("_gp_") or name in module._modules:
            continue
        if name in module._parameters or name in module._buffers:
            if attribute_value(module, name) is not None:
                result[leaf_node_name(name)] = name
            continue
        static = inspect.getattr_static(module, name, None)
        if isinstance(static, (property, staticmethod, classmethod)) or inspect.isdatadescriptor(static):
            continue
        value = module.__dict__.get(name, static)
        if isinstance(value, nn.Module) or callable(value) or inspect.ismethoddescriptor(value):
            continue
        result[leaf_node_name(name)] = name
    return result


def attribute_value(module: nn.Module, name: str) -> Any:
    """The value of attribute ``name`` of ``module``, read from its registries and ``__dict__`` (never through
    ``__getattr__``, which an active fx tracer intercepts)."""
    for registry in (module._parameters, module._buffers, module.__dict__):
        if name in registry:
            return registry[name]
    return inspect.getattr_static(module, name)


def pretrained_base(module: nn.Module) -> type | None:
    """transformers' ``PreTrainedModel`` when ``module`` is one, else ``None`` (transformers is not imported for it:
    a model of it means it already is)."""
    base: Any = getattr(sys.modules.get("transformers"), "PreTrainedModel", None)
    return base if base is not None and isinstance(module, base) else None


def _pretrained_namespace(module: nn.Module) -> frozenset[str]:
    base = pretrained_base(module)
    if base is None:
        return frozenset()
    return frozenset(dir(base)) | frozenset(getattr(base, "__annotations__", {})) | _TRANSFORMERS_ATTRIBUTES
