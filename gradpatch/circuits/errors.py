"""Exception types of attribution graphs (:mod:`gradpatch.circuits`)."""

from __future__ import annotations

from ..dictionaries.errors import DictionaryConfigError
from ..errors import GradpatchError


class CircuitError(GradpatchError, ValueError):
    """An attribution graph that cannot be built as asked: no transcoders, a dictionary that is not a transcoder, a
    threshold outside [0, 1], a prompt of more than one row (the message names the fix)."""


class FrozenNodesNotFoundError(CircuitError):
    """The graph lacks the nodes that the local replacement model freezes (attention probabilities or normalisation
    scales); the message names the operations looked for."""


class NoPathError(CircuitError):
    """A transcoder's node off every path from the token embeddings to the logits: an input node that does not
    depend on the embeddings, or an output node that the logits do not depend on; the message names the node."""


class MemoryBoundError(CircuitError):
    """A memory bound (``max_memory_bytes``) too small for one row of an attribution graph's backward passes; the
    message gives the bytes needed."""


class IncompleteGraphError(CircuitError):
    """An attribution graph whose target rows do not sum to the targets' values (its edges plus its bias): the
    replacement model is not affine from the sources to that target, because a nonlinearity on the way is neither
    frozen nor linearised; the message names the node and the error."""


class FeatureIndexError(CircuitError, DictionaryConfigError):
    """An edit of a feature outside its transcoder's latents ``0..d_sae − 1``, raised alike by
    :func:`~gradpatch.circuits.intervene` and :func:`~gradpatch.circuits.intervene_direct` before any forward pass. Both a :class:`CircuitError` and a
    :class:`~gradpatch.dictionaries.DictionaryConfigError` (what ``splice`` raises for a latent out of range), so
    either ``except`` catches it; the message names the valid range."""


class AttentionFitError(CircuitError):
    """An attention layer whose pre-softmax score is not q · k · scale plus a constant (a nonlinearity between the
    scores and the softmax, or queries and keys that are not nodes), or a QK request out of range; the message names
    the op or the range."""
