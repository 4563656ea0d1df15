"""The rows of the adjacency from one backward pass's gradients: A[t, s] = g · contribution (module docstring of
:mod:`gradpatch.circuits.attribute`).

Every source sits at one position of one written tensor: a feature (ℓ, p, f) of a transcoder writes a_ℓpf W_dec[f]
into the MLP output of ℓ at p (a cross-layer transcoder's feature writes into every MLP output ℓ' ≥ ℓ, through each
of its decoder blocks, :func:`~gradpatch.circuits.complete.decoder_blocks`, and its edge is the sum), an error node
(ℓ, p) writes e_ℓp there, a token p writes its embedding E_p into the embeddings. So for each written tensor and
position p, the edges of its sources there are one product g_p [rows, d] · V_p [d, sources at p]: one batched matrix
product over positions (:class:`SourceBlock`; positions padded to the most sources at one position), which reads the
gradient once, instead of gathering a ``[rows, sources, d]`` copy of it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .complete import decoder_blocks
from .replacement import ReplacementModel

__all__ = ["FEATURE_CHUNK", "TILE", "SourceBlock", "edges", "source_blocks"]

#: Source vectors ``[d]`` built at once per written tensor (positions are taken in chunks of at most this many
#: source slots), bounding the memory of the contraction.
FEATURE_CHUNK = 1024
#: Rows per matrix product of the contraction, and the multiple its slots are padded to (:func:`edges`).
TILE = 8


@dataclass(frozen=True)
class SourceBlock:
    """Sources written into one tensor (an MLP output, or the embeddings) through one decoder, by position.

    Attributes:
        written: the layer whose MLP output they write; ``None``: the embeddings.
        ids: the feature id in each slot ``[seq, slots]`` (0 in empty slots).
        scales: a_ℓpf in each feature slot ``[seq, slots]`` (0 in empty slots).
        decoder: the decoder ``[m, d]`` the features write through (``None`` without feature slots).
        vectors: one more source per position after the feature slots ``[seq, d]`` (the error vectors e_ℓp, or the
            embeddings); ``None``: none (a cross-layer transcoder's other layers' features).
        columns: the column of each slot, features then the vector ``[seq, slots (+ 1)]`` (n, a column dropped at
            the end, for empty slots and for the error nodes at position 0 when they get no edges).
    """

    written: int | None
    ids: torch.Tensor
    scales: torch.Tensor
    decoder: torch.Tensor | None
    vectors: torch.Tensor | None
    columns: torch.Tensor


def _feature_block(written: int, features: torch.Tensor, activations: torch.Tensor, columns: torch.Tensor,
                   decoder: torch.Tensor, seq: int, n_nodes: int, vectors: torch.Tensor | None,
                   vector_columns: torch.Tensor | None) -> SourceBlock:
    """The :class:`SourceBlock` of the features ``columns`` (rows of ``features`` ``[k, 3]``) writing ``written``
    through ``decoder``, with ``vectors`` (columns ``vector_columns`` ``[seq]``) after them."""
    positions = features[columns, 1]
    width = 0
    slots = positions.new_zeros(0)
    if len(positions):
        counts = torch.bincount(positions, minlength=seq)
        starts = torch.cumsum(counts, 0) - counts
        order = torch.argsort(positions, stable=True)
        slots = torch.empty_like(positions)
        slots[order] = torch.arange(len(positions), device=positions.device) - starts[positions[order]]
        width = int(counts.max())
    ids = features.new_zeros(seq, width)
    scales = torch.zeros(seq, width, device=features.device)
    slot_columns = features.new_full((seq, width + (vectors is not None)), n_nodes)
    ids[positions, slots] = features[columns, 2]
    scales[positions, slots] = activations[columns].float()
    slot_columns[positions, slots] = columns
    if vector_columns is not None:
        slot_columns[:, width] = vector_columns
    return SourceBlock(written, ids, scales, decoder if width else None, vectors, slot_columns)


def source_blocks(model: ReplacementModel, active: torch.Tensor, activations: torch.Tensor, error_start: int,
                  token_start: int, n_nodes: int, first: int) -> list[SourceBlock]:
    """The :class:`SourceBlock` s of every spliced layer's MLP output (the features of each layer whose decoder
    blocks write it, :func:`~gradpatch.circuits.complete.decoder_blocks`, and its error nodes, with the layer's own
    features) and of the embeddings (the tokens).

    Args:
        active: the feature nodes (layer, position, feature) ``[k, 3]``, column i = feature i.
        activations: their activations ``[k]``.
        error_start, token_start: the columns of the first error node and of the first token.
        n_nodes: n, the columns.
        first: 1 when the error nodes at position 0 get no edges.
    """
    device = model.embeddings.device
    features, activations = active.to(device), activations.to(device)
    seq = model.ids.shape[1]
    positions = torch.arange(seq, device=device)
    rank = {layer: index for index, layer in enumerate(sorted(model.layers))}
    blocks = []
    for layer in sorted(model.layers):
        columns = (features[:, 0] == layer).nonzero().squeeze(-1)
        for written, decoder in decoder_blocks(model, layer):
            vectors = vector_columns = None
            if written == layer:  # the error nodes of the MLP output, with the features of its own layer
                vectors = model.layers[layer].errors[0]
                vector_columns = torch.where(positions < first, n_nodes, error_start + rank[layer] * seq + positions)
            blocks.append(_feature_block(written, features, activations, columns, decoder, seq, n_nodes, vectors,
                                         vector_columns))
    blocks.append(SourceBlock(None, features.new_zeros(seq, 0), torch.zeros(seq, 0, device=device), None,
                              model.embeddings[0], (token_start + positions)[:, None]))
    return blocks


def edges(blocks: list[SourceBlock], gradients: dict[int, torch.Tensor], embed_gradient: torch.Tensor,
          n_nodes: int) -> torch.Tensor:
    """The rows ``[rows, n]`` of the adjacency (float32) from each row's gradients at the MLP outputs ``[rows,
    length, d_out]`` (layers absent: zero) and at the embeddings ``[rows, length, d_model]`` (module docstring);
    sources at positions ≥ length get 0 (a target reaches no later position).

    The products have one shape whatever the batch (:data:`TILE` rows, the slots padded to a multiple of
    :data:`TILE`), so that a row does not depend on the other rows of its backward pass: a matrix product's
    summation order depends on its sizes."""
    rows, length = embed_gradient.shape[0], embed_gradient.shape[1]
    made = torch.zeros(rows, n_nodes + 1, dtype=torch.float32, device=embed_gradient.device)
    for block in blocks:
        gradient = embed_gradient if block.written is None else gradients.get(block.written)
        if gradient is None or not block.columns.shape[1]:
            continue
        width = block.columns.shape[1]
        padded = -(-width // TILE) * TILE
        step = max(1, FEATURE_CHUNK // padded)
        for start in range(0, length, step):
            stop = min(start + step, length)
            vectors = torch.zeros(stop - start, padded, gradient.shape[-1], device=made.device)
            slots = block.ids.shape[1]
            if block.decoder is not None:
                vectors[:, :slots] = block.decoder[block.ids[start:stop]].float() * block.scales[start:stop, :, None]
            if block.vectors is not None:
                vectors[:, slots] = block.vectors[start:stop].float()
            columns = block.columns[start:stop].reshape(-1)
            for first in range(0, rows, TILE):
                tile = gradient[first:first + TILE, start:stop].float()
                if len(tile) < TILE:
                    tile = torch.cat([tile, tile.new_zeros(TILE - len(tile), *tile.shape[1:])])
                products = torch.bmm(tile.transpose(0, 1), vectors.transpose(1, 2))  # [positions, TILE, padded]
                kept = min(TILE, rows - first)
                made[first:first + kept].index_add_(1, columns, products[:, :kept, :width].transpose(0, 1)
                                                    .reshape(kept, -1))
    return made[:, :n_nodes]
