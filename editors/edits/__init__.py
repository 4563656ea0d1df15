"""Edits as objects: a rank-one or low-rank weight update that is applied, restored bit-identically, saved as
safetensors + JSON and loaded back (:class:`Edit` for one layer, :class:`BatchEdit` for MEMIT's several), and the patch
form of an edit for layers whose weights cannot be written (bitsandbytes, accelerate offload).

Names are imported on first use (:func:`editors.lazy.lazy_exports`).
"""

from __future__ import annotations

from ..lazy import lazy_exports

#: Public name -> submodule that defines it.
_EXPORTS: dict[str, str] = {
    "BatchEdit": "batch",
    "Edit": "edit",
    "apply_edits": "edit",
    "load_edits": "edit",
    "read_edit_folder": "edit",
    "restore_edits": "edit",
    "save_edits": "edit",
    "FORMAT": "files",
    "VERSION": "files",
    "factor_shapes": "files",
    "read_edit_files": "files",
    "write_edit_files": "files",
    "KeyCapture": "patches",
    "LowRankAdd": "patches",
    "low_rank_patches": "patches",
    "updated_weight_patches": "patches",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
