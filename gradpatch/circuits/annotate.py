"""The optional fields of ``graph.json`` that ``graph.html`` (:func:`~gradpatch.circuits.html.graph_html`) reads:
the graph's scores, the MLP layers left live, and each feature node's top logits and top activating snippets.

Added to circuit-tracer's frontend dict (:func:`~gradpatch.circuits.files.frontend_graph`) by
:func:`annotate_frontend`:

- ``metadata["scores"]``: ``{"replacement_score", "completeness_score"}`` of the unpruned graph
  (:func:`~gradpatch.circuits.prune.graph_scores`);
- ``metadata["live_mlp_layers"]``: the model's layers whose MLP has no transcoder (:func:`live_mlp_layers`): their
  MLPs run as in the model on the prompt and are folded into the edges (no feature or error node of theirs);
- per feature node, ``"top_logits"`` / ``"bottom_logits"``: the tokens the feature's decoder direction promotes most
  / suppresses most through the unembedding, ``[{"token", "text", "weight"}]`` (:func:`decoder_logit_weights`;
  circuit-tracer's feature files have the same two lists, ``top_logits`` and ``bottom_logits``);
- per feature node, ``"top_snippets"`` ``[{"text", "activation"}]``, when the caller gives snippets (e.g.
  :func:`gradpatch.dictionaries.top_activations.top_activating_snippets`).

Neuronpedia's graph schema (draft-07, ``metadata`` and node objects without ``additionalProperties: false``) accepts
these extra keys where they are.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import torch
from torch import nn

from ..layouts import count_layers, detect_layout
from .attribute import AttributionGraph
from .complete import decoder_blocks
from .errors import CircuitError
from .node_ids import parse_node_id
from .prune import GraphInfluence, graph_scores
from .replacement import ReplacementModel

__all__ = ["annotate_frontend", "decoder_logit_weights", "live_mlp_layers"]

#: Feature nodes' rows of ``W_dec`` pushed through the unembedding at once (``[chunk, vocab]`` floats each time).
_CHUNK = 256


class SnippetLike(Protocol):
    """A top activating snippet: its text (the activating token marked) and the latent's activation there."""

    text: str
    activation: float


def live_mlp_layers(replacement: ReplacementModel) -> list[int]:
    """The model's layers (ascending) whose MLP has no transcoder in ``replacement``: those MLPs stay live, that is
    run as in the model (their effect is inside the graph's edges, with no node of their own).

    Raises:
        LayoutError: the model's blocks are not found (:func:`~gradpatch.layouts.detect_layout`).
    """
    n_layers = count_layers(replacement.pg, detect_layout(replacement.pg))
    return [layer for layer in range(n_layers) if layer not in replacement.layers]


def _unembedding(replacement: ReplacementModel) -> tuple[torch.Tensor, nn.Module | None]:
    """(W_U ``[vocab, d_model]``, the final norm module or ``None``) of the replacement model's model."""
    pg = replacement.pg
    unembedding = pg.wrapped_model.get_output_embeddings()
    if unembedding is None:
        raise CircuitError(f"{type(pg.wrapped_model).__name__} has no output embeddings (get_output_embeddings() is "
                           f"None), so features have no top logits; annotate graphs of a model with an unembedding")
    W_U = unembedding.weight  # noqa: N806
    final_norm = detect_layout(pg).final_norm
    return W_U, (pg.original_module(final_norm) if final_norm is not None else None)


def decoder_logit_weights(directions: torch.Tensor, W_U: torch.Tensor,  # noqa: N803
                          final_norm: nn.Module | None = None) -> torch.Tensor:
    """The logit weights of decoder directions: ``(norm(d) − norm(0)) W_Uᵀ`` for each row d.

    Each direction is taken as the whole residual stream at the last position and passed through the final norm
    (``norm(d) − norm(0)`` removes the norm's bias): for an RMSNorm that is ``γ ⊙ d / rms(d)``, for a LayerNorm
    ``γ ⊙ (d − mean d) / std(d)``, for Gemma's norm ``(1 + w) ⊙ d / rms(d)``. So the direction is multiplied by
    the final norm's elementwise weight γ and scaled to unit RMS (a positive factor per feature: it sets no token's
    rank) before the unembedding; the unembedding's bias, the model's logit soft-capping and any norm after the MLP
    (Gemma's post-feedforward norm) are left out. Without a final norm this is ``d W_Uᵀ``. This is the direct logit
    attribution of Anthropic's and Neuronpedia's feature pages (``W_dec W_U``) with the final norm's weight folded in.

    Args:
        directions: decoder rows ``[n, d_model]`` (a transcoder's ``W_dec[f]``, what feature f adds per unit of
            activation to its MLP's output, hence to the residual stream).
        W_U: the unembedding ``[vocab, d_model]`` (``lm_head.weight``).
        final_norm: the norm before the unembedding, applied to ``[n, d_model]``.

    Returns:
        ``[n, vocab]`` float32 on ``W_U``'s device.
    """
    with torch.no_grad():
        directions = directions.to(device=W_U.device, dtype=W_U.dtype)
        if final_norm is not None:
            directions = final_norm(directions) - final_norm(torch.zeros_like(directions[:1]))
        return (directions @ W_U.T).float()


def _feature_key(node: dict[str, Any]) -> tuple[int, int]:
    """(layer, feature index in its transcoder) of a feature node, from its id (its ``feature`` is a Cantor pair)."""
    layer, _, feature = parse_node_id(node["node_id"])
    return layer, feature


def _token_weights(weights: torch.Tensor, k: int, decode: Callable[[int], str],
                   largest: bool) -> list[dict[str, Any]]:
    values, tokens = weights.topk(min(k, weights.shape[0]), largest=largest)
    return [{"token": token, "text": decode(token), "weight": value}
            for token, value in zip(tokens.tolist(), values.tolist())]


def annotate_frontend(frontend: dict[str, Any], graph: AttributionGraph, replacement: ReplacementModel,
                      decode: Callable[[int], str] = str, unpruned: GraphInfluence | None = None,
                      snippets: Mapping[tuple[int, int], Sequence[SnippetLike]] | None = None,
                      top_k: int = 8) -> dict[str, Any]:
    """``frontend`` with the optional fields of the module docstring (a new dict; ``frontend`` is not changed).

    Args:
        frontend: ``graph``'s ``graph.json`` (:func:`~gradpatch.circuits.files.frontend_graph`).
        graph: the unpruned attribution graph, for the scores.
        replacement: the replacement model ``graph`` was built from: its transcoders' ``W_dec`` ``[d_sae, d_model]``
            (a cross-layer transcoder's feature: the sum of its decoder rows into every layer, what it writes to the
            residual stream in all),
            the model's unembedding and final norm (:func:`decoder_logit_weights`) and its number of layers.
        decode: token id -> text (a tokenizer's ``decode`` of one id).
        unpruned: ``graph``'s :func:`~gradpatch.circuits.prune.graph_influence`, if already computed.
        snippets: (layer, feature) -> its top activating snippets, highest first (``text``, ``activation``); the
            first ``top_k`` of each go in; features absent from it get no ``top_snippets``.
        top_k: tokens per list (promoted, suppressed) and snippets per feature node.

    Returns:
        The annotated frontend dict.

    Raises:
        CircuitError: ``top_k`` below 1, or a model without output embeddings.
        LayoutError: a model whose blocks or final norm are not found (:func:`~gradpatch.layouts.detect_layout`).
    """
    if top_k < 1:
        raise CircuitError(f"top_k={top_k}: give at least 1 (tokens and snippets shown per feature)")
    replacement_score, completeness_score = graph_scores(graph, unpruned)
    annotated = copy.deepcopy(frontend)
    annotated["metadata"]["scores"] = {"replacement_score": replacement_score,
                                       "completeness_score": completeness_score}
    annotated["metadata"]["live_mlp_layers"] = live_mlp_layers(replacement)
    features = [node for node in annotated["nodes"] if node["feature_type"] == "cross layer transcoder"]
    keys = sorted({_feature_key(node) for node in features})
    W_U, final_norm = _unembedding(replacement)  # noqa: N806
    logits: dict[tuple[int, int], dict[str, list[dict[str, Any]]]] = {}
    for start in range(0, len(keys), _CHUNK):
        chunk = keys[start:start + _CHUNK]
        with torch.no_grad():
            rows = torch.stack([sum(decoder[feature] for _, decoder in decoder_blocks(replacement, layer))
                                for layer, feature in chunk])
        weights = decoder_logit_weights(rows, W_U, final_norm).cpu()
        for key, row in zip(chunk, weights):
            logits[key] = {"top_logits": _token_weights(row, top_k, decode, largest=True),
                           "bottom_logits": _token_weights(row, top_k, decode, largest=False)}
    for node in features:
        key = _feature_key(node)
        node.update(logits[key])
        if snippets is not None and key in snippets:
            node["top_snippets"] = [{"text": str(s.text), "activation": float(s.activation)}
                                    for s in list(snippets[key])[:top_k]]
    return annotated
