"""``metrics.json`` of a dictionary: :func:`gradpatch.dictionaries.evaluate_dictionary` on tokenized documents, one
document per forward pass (no padding), written atomically. Both ``gradpatch dictionary eval`` and the end of
``gradpatch fit`` on a dictionary config write it.

One schema whatever the number of dictionaries: ``"dictionaries"`` maps each dictionary's written NodePath to its
:meth:`~gradpatch.dictionaries.DictionaryMetrics.to_dict` (our names, and SAELens's for the five metrics it
reports); the top level is left to records about the run (``gradpatch dictionary eval`` adds ``"provenance"``)::

    {"dictionaries": {"model.layers_12.output": {"fvu": 0.44, ..., "kl": 1.38, "n_tokens": 2006,
                                                 "ce_loss_without_sae": 3.00, "ce_loss_with_sae": 4.15,
                                                 "ce_loss_with_ablation": 12.23, "ce_loss_score": 0.88,
                                                 "kl_div_with_sae": 1.38}}}

:func:`write_layer_metrics` scores dictionaries at many layers (per-layer transcoders, a cross-layer transcoder) with
:func:`gradpatch.dictionaries.evaluate_layers`: the same ``"dictionaries"`` entries (each layer spliced alone), and
``"all_spliced"``: every layer spliced at once, without error terms
(:meth:`~gradpatch.dictionaries.AllSplicedMetrics.to_dict`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from gradpatch.dictionaries import (DictionaryLayers, DictionaryMetrics, LayerMetrics, SparseDictionary,
                                    evaluate_dictionary, evaluate_layers)
from gradpatch.files.atomic import atomic_write_text
from gradpatch.model_io import model_device

__all__ = ["ALL_SPLICED_KEY", "METRICS_KEY", "METRICS_NAME", "write_dictionary_metrics", "write_layer_metrics"]

METRICS_NAME = "metrics.json"
#: The key of ``metrics.json`` that maps each written NodePath to its metrics.
METRICS_KEY = "dictionaries"
#: The key of ``metrics.json`` that holds the metrics with every layer spliced at once (:func:`write_layer_metrics`).
ALL_SPLICED_KEY = "all_spliced"


def write_dictionary_metrics(pg: Any, dictionary: SparseDictionary | Sequence[SparseDictionary],
                             documents: list[list[int]], folder: str | Path, node: str | None = None,
                             output_node: str | None = None) -> dict[str, DictionaryMetrics]:
    """Evaluate ``dictionary`` spliced into ``pg`` (without its error term) on ``documents`` and write
    ``folder/metrics.json``: ``{"dictionaries": {written node: metrics.to_dict()}}`` (the module docstring), one
    entry per dictionary (several are each evaluated alone), the same shape for one dictionary as for several.

    Args:
        pg: the :class:`gradpatch.PatchableGraph`.
        dictionary: the SAE or transcoder (moved to the model's device), or several.
        documents: token ids, one list per document (each ``[1, len]`` in its own forward pass).
        folder: where ``metrics.json`` goes (created if missing); nothing is written when evaluation fails.
        node, output_node: the NodePaths read and written (default: the dictionary's config's; one dictionary only).

    Returns:
        ``{written node: metrics}``.

    Raises:
        DictionaryConfigError, NodePathError, DictionaryShapeError: as :func:`gradpatch.dictionaries.splice`.
    """
    device = model_device(pg)
    batches = [torch.tensor([ids], device=device) for ids in documents]
    dictionaries = [dictionary] if isinstance(dictionary, SparseDictionary) else list(dictionary)
    scores = {}
    for one in dictionaries:
        written = output_node or node or one.config.output_node or one.config.input_node
        scores[str(written)] = evaluate_dictionary(pg, one.to(device), batches, node=node, output_node=output_node)
    document = {METRICS_KEY: {name: metrics.to_dict() for name, metrics in scores.items()}}
    atomic_write_text(Path(folder) / METRICS_NAME, json.dumps(document, indent=2) + "\n")
    return scores


def write_layer_metrics(pg: Any, layers: DictionaryLayers, documents: list[list[int]],
                        folder: str | Path) -> LayerMetrics:
    """Evaluate dictionaries at many layers (:func:`gradpatch.dictionaries.evaluate_layers`, one document per forward
    pass) and write ``folder/metrics.json``: ``{"dictionaries": {written node: metrics}, "all_spliced": {...}}``.

    Args:
        pg: the :class:`gradpatch.PatchableGraph`.
        layers: :func:`gradpatch.dictionaries.per_layer_dictionaries` or
            :func:`~gradpatch.dictionaries.cross_layer_layers` (moved to the model's device here).
        documents: token ids, one list per document.
        folder: where ``metrics.json`` goes (created if missing); nothing is written when evaluation fails.

    Returns:
        The :class:`~gradpatch.dictionaries.LayerMetrics`.

    Raises:
        NodePathError: a NodePath the graph lacks.
    """
    device = model_device(pg)
    for module in layers.modules:
        module.to(device)
    scores = evaluate_layers(pg, layers, [torch.tensor([ids], device=device) for ids in documents])
    document = {METRICS_KEY: {name: metrics.to_dict() for name, metrics in scores.layers.items()},
                ALL_SPLICED_KEY: scores.all_spliced.to_dict()}
    atomic_write_text(Path(folder) / METRICS_NAME, json.dumps(document, indent=2) + "\n")
    return scores
