"""Training sparse dictionaries (:mod:`gradpatch.dictionaries`) in Lightning on a frozen PatchableGraph's activations.

- :class:`DictionaryModule`: local losses on activations streamed through a bounded shuffle buffer.
- :class:`EndToEndDictionaryModule`: KL between the model and the model with the dictionary spliced (Braun et al.).
- :class:`ActivationBuffer`: that buffer.

See docs/dictionaries.md.
"""

from .buffer import ActivationBuffer
from .end_to_end import EndToEndDictionaryModule
from .module import AUXK_COEFFICIENT, DictionaryModule

__all__ = ["AUXK_COEFFICIENT", "ActivationBuffer", "DictionaryModule", "EndToEndDictionaryModule"]
