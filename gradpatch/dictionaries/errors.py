"""Exception types of the sparse dictionaries (:mod:`gradpatch.dictionaries`)."""

from __future__ import annotations

from ..errors import GradpatchError, PatchShapeError


class DictionaryError(GradpatchError):
    """Base class of the dictionaries' errors."""


class DictionaryConfigError(DictionaryError, ValueError):
    """A dictionary that cannot be built as asked: an unknown kind or activation, ``k`` outside ``1..d_sae``, a
    width below 1, a skip term on a sparse autoencoder; the message names the fix."""


class DictionaryLoadError(DictionaryError, ValueError):
    """Saved dictionary files that are missing, unreadable, of another format, or inconsistent: a missing tensor, a
    tensor whose shape does not fit the config, a NaN or ±inf, an option gradpatch does not implement (the message
    names the file and the fix). Raised before anything is built or spliced."""


class DictionaryShapeError(DictionaryError, PatchShapeError):
    """A dictionary spliced at a node whose activation has another width, or a transcoder whose input and output
    nodes disagree in their leading (batch, position) sizes or run in the wrong order."""
