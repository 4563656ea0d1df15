"""The model with several dictionaries spliced at once, and the next-token cross-entropy it loses.

Training logs the CE loss increase on its own batches (CE with the dictionaries spliced, without their error terms,
minus the model's CE), the number ``metrics.json`` reports after training on held-out tokens
(:func:`gradpatch.dictionaries.evaluate_dictionary`'s ``ce_loss_spliced − ce_loss_original``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
import torch.nn.functional as F

from gradpatch.dictionaries import DictionaryLayers, Splice, SparseDictionary, splice, splice_layers, trained_positions

__all__ = ["next_token_ce", "splice_all", "spliced_ce_increase"]


def next_token_ce(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of ``logits`` ``[batch, seq, vocab]`` on token ids ``[batch, seq]``, over every
    position that has a next token (a scalar, float32)."""
    return F.cross_entropy(logits[:, :-1].float().flatten(0, 1), ids[:, 1:].flatten())


@contextmanager
def splice_all(pg: Any, dictionaries: Sequence[SparseDictionary], error_term: bool = False) -> Iterator[list[Splice]]:
    """Splice every dictionary at its config's nodes and trained positions (:func:`gradpatch.dictionaries.splice`
    with :func:`~gradpatch.dictionaries.trained_positions`, nested patch blocks) for the ``with`` block; yields the
    splices (their ``latents`` ``[batch, seq − exclude_first_positions, m]`` after a forward pass).

    Raises:
        NodePathError, DictionaryShapeError: as :func:`gradpatch.dictionaries.splice` and ``pg.patch``.
    """
    splices = [splice(pg, d, str(d.config.input_node), output_node=d.config.output_node, error_term=error_term,
                      slice=trained_positions(d)) for d in dictionaries]
    with ExitStack() as stack:
        for spliced in splices:
            stack.enter_context(pg.patch(spliced))
        yield splices


def spliced_ce_increase(pg: Any, dictionaries: Sequence[SparseDictionary] | DictionaryLayers, ids: torch.Tensor,
                        rows_per_pass: int = 2) -> torch.Tensor:
    """CE(model with every dictionary spliced, no error terms) − CE(model) on token ids ``[batch, seq]``, without
    gradients (``dictionaries``: per-node dictionaries, or the layers of a cross-layer transcoder,
    :func:`gradpatch.dictionaries.splice_layers`), with
    gradients: two forward passes per ``rows_per_pass`` sequences, so that at most ``rows_per_pass × seq × vocab``
    logits exist at once (a whole training batch of 16 × 128 tokens at SmolLM2's 49,152 vocabulary is 403 MB of float32
    logits per pass: it raised the training's peak resident memory by ~1 GB every ``ce_every_n_steps``). Each
    sequence has ``seq − 1`` next tokens, so the mean over the chunks' means is the mean over the batch."""
    def summed_ce() -> torch.Tensor:  # Σ over the chunks of their mean CE × their sequences
        return torch.stack([next_token_ce(pg(rows, use_cache=False).logits, rows) * len(rows)
                            for rows in ids.split(rows_per_pass)]).sum()

    with torch.no_grad():
        original = summed_ce()
        spliced_in = (splice_layers(pg, dictionaries) if isinstance(dictionaries, DictionaryLayers)
                      else splice_all(pg, dictionaries))
        with spliced_in:  # the splices built once for every chunk
            spliced = summed_ce()
    return (spliced - original) / ids.shape[0]
