"""``metrics.json`` of a dictionary: :func:`gradpatch.dictionaries.evaluate_dictionary` on tokenized documents, one
document per forward pass (no padding), written atomically. Both ``gradpatch dictionary eval`` and the end of
``gradpatch fit`` on a dictionary config write it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from gradpatch.dictionaries import DictionaryMetrics, SparseDictionary, evaluate_dictionary
from gradpatch.files.atomic import atomic_write_text
from gradpatch.model_io import model_device

__all__ = ["METRICS_NAME", "write_dictionary_metrics"]

METRICS_NAME = "metrics.json"


def write_dictionary_metrics(pg: Any, dictionary: SparseDictionary, documents: list[list[int]], folder: str | Path,
                             node: str | None = None, output_node: str | None = None) -> DictionaryMetrics:
    """Evaluate ``dictionary`` spliced into ``pg`` (without its error term) on ``documents`` and write the metrics
    to ``folder/metrics.json`` (the keys of :meth:`~gradpatch.dictionaries.DictionaryMetrics.to_dict`).

    Args:
        pg: the :class:`gradpatch.PatchableGraph`.
        dictionary: the SAE or transcoder (moved to the model's device).
        documents: token ids, one list per document (each ``[1, len]`` in its own forward pass).
        folder: where ``metrics.json`` goes (created if missing); nothing is written when evaluation fails.
        node, output_node: the NodePaths read and written (default: the dictionary's config's).

    Returns:
        The metrics.

    Raises:
        DictionaryConfigError, NodePathError, DictionaryShapeError: as :func:`gradpatch.dictionaries.splice`.
    """
    device = model_device(pg)
    batches = [torch.tensor([ids], device=device) for ids in documents]
    metrics = evaluate_dictionary(pg, dictionary.to(device), batches, node=node, output_node=output_node)
    atomic_write_text(Path(folder) / METRICS_NAME, json.dumps(metrics.to_dict(), indent=2) + "\n")
    return metrics
