"""The node ids and feature numbers of ``graph.json`` as circuit-tracer writes and reads them.

Ids (circuit-tracer's ``frontend/graph_models.py`` ``Node``; the error id is its current form, upstream commit
196e2ce, since 0.5.0's ``0_{layer}_{pos}`` is read back by its own ``decode_url_features`` as layer-0 feature
``layer``)::

    feature  {layer}_{feature}_{pos}       jsNodeId {layer}_{feature}-0
    error    {layer}_-1_{pos}              jsNodeId {layer}_-1-{pos}
    token    E_{token id}_{pos}            jsNodeId E_{token id}-{pos}
    logit    {n_layers + 1}_{vocab id}_{pos}   jsNodeId L_{vocab id}-{pos}

:func:`parse_node_id` reads an id back as circuit-tracer's ``utils/decode_url_features.py`` does: ``E_{t}_{p}`` is
``(-1, p, t)``, any other ``{a}_{b}_{c}`` is ``(a, c, b)`` (layer, position, feature; -1 for an error). A feature
node's ``feature`` field is :func:`cantor_pair` ``(layer, feature)`` (0.5.0's ``Node.feature_node``, with
``metadata.schema_version`` 1; its frontend's ``util.cantorUnpair`` and Neuronpedia undo it).
"""

from __future__ import annotations

import math

from .errors import CircuitError

__all__ = ["cantor_pair", "cantor_unpair", "error_id", "feature_id", "logit_id", "parse_node_id", "token_id"]


def cantor_pair(x: int, y: int) -> int:
    """The Cantor pairing ``(x + y)(x + y + 1)/2 + y`` of two integers ≥ 0 (circuit-tracer's ``_cantor_pairing``)."""
    return (x + y) * (x + y + 1) // 2 + y


def cantor_unpair(z: int) -> tuple[int, int]:
    """``(x, y)`` with :func:`cantor_pair` ``(x, y) == z`` (circuit-tracer's frontend ``util.cantorUnpair``).

    Raises:
        CircuitError: ``z < 0`` (an error node's ``feature`` -1 is no pair).
    """
    if z < 0:
        raise CircuitError(f"{z} is no Cantor pair (those are >= 0); an error node's feature is -1")
    w = (math.isqrt(8 * z + 1) - 1) // 2
    y = z - w * (w + 1) // 2
    return w - y, y


def feature_id(layer: int, feature: int, position: int) -> str:
    """A feature node's id."""
    return f"{layer}_{feature}_{position}"


def error_id(layer: int, position: int) -> str:
    """The id of layer ``layer``'s error node at ``position``."""
    return f"{layer}_-1_{position}"


def token_id(token: int, position: int) -> str:
    """The id of the embedding node of token id ``token`` at ``position``."""
    return f"E_{token}_{position}"


def logit_id(n_layers: int, token: int, position: int) -> str:
    """The id of the logit node of vocabulary id ``token`` (at the last ``position``) of an ``n_layers`` model."""
    return f"{n_layers + 1}_{token}_{position}"


def parse_node_id(node_id: str) -> tuple[int, int, int]:
    """``(layer, position, feature)`` of ``node_id`` as circuit-tracer's ``decode_url_features`` reads it (module
    docstring): a token's layer is -1 and its feature the token id; an error's feature is -1.

    Raises:
        CircuitError: an id of neither form.
    """
    parts = node_id[2:].split("_") if node_id.startswith("E_") else node_id.split("_")
    try:
        numbers = [int(part) for part in parts]
    except ValueError:
        numbers = []
    if node_id.startswith("E_") and len(numbers) == 2:
        return -1, numbers[1], numbers[0]
    if len(numbers) == 3:
        return numbers[0], numbers[2], numbers[1]
    raise CircuitError(f"node id {node_id!r} is neither E_{{token}}_{{pos}} nor {{layer}}_{{feature}}_{{pos}} "
                       f"(circuit-tracer's graph.json ids)")
