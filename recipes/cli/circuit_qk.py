"""``gradpatch circuit``'s attention options: QK attributions of chosen scores and head loadings of the logits'
edges, written beside the graph (docs/attention.md).

::

    gradpatch circuit --prompt "..." --dictionaries tc/ --qk 3@7:-1 --qk 0@5:12:4 --head-loadings --out runs/c

``--qk HEAD@LAYER:QPOS[:KPOS]`` (repeatable): the pre-softmax score of query head HEAD of attention layer LAYER at
query position QPOS (negative: from the end, -1 the last) and key position KPOS, or, without KPOS, the ``--qk-keys``
keys the pattern row weighs most, decomposed into (query-side node) × (key-side node) terms
(:func:`gradpatch.circuits.qk.qk_attributions`); ``OUT/qk.json`` lists each score, its pattern weight, how far the
terms miss it and its ``--qk-top-terms`` largest terms with their nodes' labels. ``--head-loadings``: the edges into
every logit node from its ``--head-loading-sources`` strongest sources, split per attention layer into per-head
loadings and a bypass (:func:`gradpatch.circuits.heads.head_loadings`): ``OUT/head_loadings.safetensors`` (sparse
indices and values) and ``OUT/head_loadings.json`` (per edge, per layer: the heads' loadings and the bypass).

Both work with any ``--dictionaries`` the command takes, per-layer transcoders or a cross-layer transcoder (a CLT
feature's query-, key- and edge-side contributions go through its decoder blocks into every later MLP output).
The circuit command calls :func:`add_qk_options` on its parser and, after attribution, :func:`write_qk_results` with
the replacement model, the graph and the staged output folder.
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["QKRequest", "add_qk_options", "check_qk_options", "parse_qk", "write_qk_results"]

_QK = re.compile(r"(\d+)@(\d+):(-?\d+)(?::(-?\d+))?")


@dataclass(frozen=True)
class QKRequest:
    """One ``--qk``: head, attention layer, query position, key position (``None``: the pattern's top keys)."""

    head: int
    layer: int
    query: int
    key: int | None


def parse_qk(text: str) -> QKRequest:
    """``HEAD@LAYER:QPOS[:KPOS]`` as a :class:`QKRequest`.

    Raises:
        ValueError: another form (the message shows the form and an example).
    """
    match = _QK.fullmatch(text.strip())
    if match is None:
        raise ValueError(f"--qk {text!r}: write HEAD@LAYER:QPOS[:KPOS] (e.g. 3@7:-1 for head 3 of attention layer 7 "
                         f"at the last position and its top keys, or 3@7:-1:4 for key position 4)")
    head, layer, query, key = match.groups()
    return QKRequest(int(head), int(layer), int(query), None if key is None else int(key))


def add_qk_options(parser: argparse.ArgumentParser) -> None:
    """Add ``--qk``, ``--qk-keys``, ``--qk-top-terms``, ``--head-loadings`` and ``--head-loading-sources``."""
    parser.add_argument("--qk", action="append", default=[], metavar="HEAD@LAYER:QPOS[:KPOS]",
                        help="QK attribution of one attention score (repeatable; QPOS/KPOS negative from the end; "
                             "without KPOS the pattern's top keys): OUT/qk.json")
    parser.add_argument("--qk-keys", type=int, default=3, metavar="K",
                        help="keys per --qk without KPOS, the pattern row's largest (default %(default)s)")
    parser.add_argument("--qk-top-terms", type=int, default=10, metavar="N",
                        help="terms listed per score, largest |value| first (default %(default)s)")
    parser.add_argument("--head-loadings", action="store_true",
                        help="split the edges into the logit nodes across attention heads: "
                             "OUT/head_loadings.safetensors and OUT/head_loadings.json")
    parser.add_argument("--head-loading-sources", type=int, default=20, metavar="N",
                        help="edges split per logit node, its strongest sources (default %(default)s)")


def check_qk_options(args: argparse.Namespace) -> str | None:
    """The usage error of the options :func:`add_qk_options` adds, else ``None`` (``--qk`` forms included)."""
    for name in ("qk_keys", "qk_top_terms", "head_loading_sources"):
        if getattr(args, name) < 1:
            return f"--{name.replace('_', '-')} {getattr(args, name)}: give at least 1"
    try:
        for text in args.qk:
            parse_qk(text)
    except ValueError as error:
        return str(error)
    return None


def _requests(model: Any, requests: list[QKRequest], keys: int, seq: int) -> list[tuple[int, int, int, int, float]]:
    """(layer, head, query, key, pattern weight) per score: the given key, or the pattern row's top ``keys``."""
    from gradpatch.circuits.attention import AttentionFitError
    from gradpatch.circuits.qk import pattern_row

    scores = []
    for request in requests:
        query = request.query % seq if -seq <= request.query < seq else request.query
        if not 0 <= query < seq:
            raise AttentionFitError(f"--qk {request.head}@{request.layer}:{request.query}: the prompt has {seq} "
                                    f"positions")
        row = pattern_row(model, request.layer, query)
        if not 0 <= request.head < row.shape[0]:
            raise AttentionFitError(f"--qk {request.head}@{request.layer}: layer {request.layer} has {row.shape[0]} "
                                    f"heads (0 .. {row.shape[0] - 1})")
        if request.key is not None:
            key = request.key % seq if -seq <= request.key < seq else request.key
            chosen = [key]
        else:
            chosen = row[request.head].topk(min(keys, query + 1)).indices.tolist()
        scores.extend((request.layer, request.head, query, key, float(row[request.head, key]) if 0 <= key < seq
                       else 0.0) for key in chosen)  # a key out of range: qk_attributions says so
    return scores


def write_qk_results(args: argparse.Namespace, model: Any, graph: Any, folder: Path,
                     decode: Callable[[int], str] = str) -> list[Path]:
    """Compute and write what the options ask for into ``folder`` (nothing when neither ``--qk`` nor
    ``--head-loadings`` is given).

    Args:
        args: the parsed arguments (:func:`add_qk_options`'s).
        model: the :class:`~gradpatch.circuits.ReplacementModel` the graph was built on.
        graph: its :class:`~gradpatch.circuits.AttributionGraph`.
        folder: the output folder.
        decode: token id -> text, for the nodes' labels.

    Returns:
        The files written.

    Raises:
        AttentionFitError: a model whose attention does not fit, a layer, head or position out of range, or a key
            the mask hides (the message names it).
    """
    from gradpatch.circuits.heads import head_loadings, save_head_loadings
    from gradpatch.circuits.qk import qk_attributions, source_label
    from gradpatch.files.atomic import atomic_write_text

    written: list[Path] = []
    if args.qk:
        scores = _requests(model, [parse_qk(text) for text in args.qk], args.qk_keys, graph.n_pos)
        attributions = qk_attributions(model, graph, [score[:4] for score in scores])
        records = []
        for (_, _, _, _, weight), attribution in zip(scores, attributions):
            missed, size = attribution.reconstruction()
            records.append({
                "layer": attribution.layer, "head": attribution.head, "query_position": attribution.query_position,
                "key_position": attribution.key_position, "pattern": weight, "score": attribution.score,
                "mask": attribution.mask, "scale": attribution.scale, "missed": missed, "terms_abs_sum": size,
                "query_nodes": len(attribution.query_nodes), "key_nodes": len(attribution.key_nodes),
                "top_terms": [{"query_node": t.query_node, "key_node": t.key_node, "value": t.value,
                               "query": source_label(graph, t.query_node, decode),
                               "key": source_label(graph, t.key_node, decode)}
                              for t in attribution.top_terms(args.qk_top_terms)]})
        written.append(atomic_write_text(folder / "qk.json", json.dumps({"scores": records}, indent=1,
                                                                         ensure_ascii=False)))
    if args.head_loadings:
        targets = list(range(graph.logit_start, graph.n_nodes))
        rows = graph.rows[graph.n_features:]
        sources = [row[:graph.logit_start].abs().topk(min(args.head_loading_sources, graph.logit_start)).indices
                   .tolist() for row in rows]
        written.extend(save_head_loadings(head_loadings(model, graph, targets, sources), folder))
    return written
