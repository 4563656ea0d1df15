"""Training sparse dictionaries (:mod:`gradpatch.dictionaries`) in Lightning on a frozen PatchableGraph's activations.

- :class:`DictionaryModule`: local losses on activations streamed through a bounded shuffle buffer.
- :class:`ActivationBuffer`: that buffer.

See docs/dictionaries.md.
"""

from .buffer import ActivationBuffer
from .module import AUXK_COEFFICIENT, DictionaryModule

__all__ = ["AUXK_COEFFICIENT", "ActivationBuffer", "DictionaryModule"]
