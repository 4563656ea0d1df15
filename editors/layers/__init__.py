"""The edited layer: a linear map ``y = W k + b`` at a user-chosen NodePath (:mod:`editors.layers.linear`), or one
expert's down-projection, a slice of a mixture-of-experts block's fused weight (:mod:`editors.layers.experts`);
:func:`~editors.layers.resolve.resolve_layer` tells them apart by the NodePath.

Names are imported on first use (:func:`editors.lazy.lazy_exports`).
"""

from __future__ import annotations

from ..lazy import lazy_exports

#: Public name -> submodule that defines it.
_EXPORTS: dict[str, str] = {
    "UNROUTED_KEY_WEIGHT": "experts",
    "ExpertLayer": "experts",
    "expert_path": "experts",
    "resolve_expert_layer": "experts",
    "top_expert": "experts",
    "LinearLayer": "linear",
    "editable_graph": "linear",
    "input_name": "linear",
    "resolve_linear": "linear",
    "resolve_module": "linear",
    "resolve_layer": "resolve",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
