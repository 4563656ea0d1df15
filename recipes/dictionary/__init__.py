"""Training sparse dictionaries (:mod:`gradpatch.dictionaries`) in Lightning on a frozen PatchableGraph's activations.

- :class:`DictionaryModule`: local losses on activations streamed through a bounded shuffle buffer.
- :class:`EndToEndDictionaryModule`: KL between the model and the model with the dictionary spliced (Braun et al.).
- :class:`ActivationBuffer`: that buffer.

See docs/dictionaries.md. Names are imported on first use, so ``import recipes.dictionary`` imports neither torch
nor Lightning.
"""

from __future__ import annotations

from ..lazy import recipe_exports

#: Public name -> submodule that defines it.
_EXPORTS: dict[str, str] = {
    "AUXK_COEFFICIENT": "module",
    "ActivationBuffer": "buffer",
    "DictionaryModule": "module",
    "EndToEndDictionaryModule": "end_to_end",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = recipe_exports(__name__, _EXPORTS)
