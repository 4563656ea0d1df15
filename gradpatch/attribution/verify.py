"""Verification of an estimate: the units it ranks highest, patched exactly.

Kramár et al. 2024 (arXiv 2403.00745) use AtP and AtP* as a prefilter: the nodes are ranked by |estimate| and
activation patching verifies them in that order, so the effects that matter are measured, not estimated, at the cost
of the verified units alone; they compare methods by the recall of the true top nodes against that cost (the units
verified). :func:`verify_top` does one such step: the ``k`` units of largest |estimate| go through the batched exact
sweep, and their scores are replaced by the measured effects (``NodeScore.exact``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from ..patchable_graph import PatchableGraph
from .errors import AttributionError
from .exact import exact_sweep
from .metrics import Metric, logit_difference
from .nodes import Node, resolve_nodes
from .prompts import PromptBatch
from .records import AttributionResult, NodeScore
from .runner import Progress

__all__ = ["verify_top"]


def _nodes_of(pg: PatchableGraph, scores: Sequence[NodeScore]) -> list[Node]:
    """The nodes of ``scores``, resolved by their kinds (so heads, queries and keys split into the same units as in
    the estimate) or, for kind ``"node"``, by their NodePaths."""
    paths = {score.node for score in scores}
    names = sorted({score.kind for score in scores if score.kind != "node"})
    names += sorted({score.node for score in scores if score.kind == "node"})
    nodes = [node for node in resolve_nodes(pg, names) if node.path in paths]
    missing = paths - {node.path for node in nodes}
    if missing:
        raise AttributionError(f"the estimate scores nodes this graph lacks, e.g. {sorted(missing)[0]!r}: verify on "
                               f"the graph the estimate was computed on")
    return nodes


def verify_top(pg: PatchableGraph, batch: PromptBatch, estimate: AttributionResult, k: int,
               metric: Metric = logit_difference, *, batch_size: int = 32,
               forward_kwargs: Mapping[str, Any] | None = None, progress: Progress | None = None) -> AttributionResult:
    """Patch the ``k`` units of largest |score| of ``estimate`` exactly and put the measured effects in its place.

    Args:
        pg: the model's graph.
        batch: the prompt pairs ``[batch, seq]`` the estimate was computed on.
        estimate: node scores of AtP, AtP-IG or AtP* (GradDrop's magnitudes too: the verified units get signed
            effects).
        k: how many units to verify (all of them when ``k`` is at least their number).
        metric: the metric the estimate used (default: the mean logit difference).
        batch_size: rows per forward pass of the exact sweep.
        forward_kwargs: keyword arguments of every call of ``pg`` (those it was built with).
        progress: ``progress(done, total)`` over the verified units.

    Returns:
        A copy of ``estimate``: ``method`` + ``"+verify"``, the ``k`` top units' scores measured (``exact=True``), the
        others as estimated, passes, seconds and ``forward_tokens`` adding the sweep's (its 2 recordings, the KV-cache
        passes and ``ceil(units at p / variants)`` patched passes per position ``p``).

    Raises:
        AttributionError: ``k < 1``, an estimate without node scores (edge methods), units of nodes this graph lacks
            (before any forward pass), a clean or corrupted metric that differs from the estimate's (other prompts or
            another metric).
    """
    if k < 1:
        raise AttributionError(f"k={k}: verify at least 1 unit")
    if not estimate.scores:
        raise AttributionError(f"the {estimate.method!r} result has no node scores to verify (edge methods score "
                               f"edges; patch edges exactly with edge_patching)")
    start = time.perf_counter()
    order = sorted(range(len(estimate.scores)), key=lambda i: -abs(estimate.scores[i].score))[:k]
    chosen = [estimate.scores[i] for i in order]
    exact = exact_sweep(pg, batch, _nodes_of(pg, chosen), metric, positions=sorted({s.position for s in chosen}),
                        direction=estimate.direction, batch_size=batch_size, forward_kwargs=forward_kwargs,
                        progress=progress, only=[(s.node, s.position, s.head) for s in chosen])
    for name, mine, theirs in (("clean", estimate.metric_clean, exact.metric_clean),
                               ("corrupted", estimate.metric_corrupted, exact.metric_corrupted)):
        if not math.isclose(mine, theirs, rel_tol=1e-3, abs_tol=1e-3):
            raise AttributionError(f"the {name} metric is {theirs:.4f} here but {mine:.4f} in the estimate: verify "
                                   f"with the prompts and metric the estimate was computed with")
    measured = exact.score_map()
    scores = [replace(s, score=measured[(s.node, s.position, s.head)], exact=True)
              if (s.node, s.position, s.head) in measured else s for s in estimate.scores]
    return AttributionResult(f"{estimate.method}+verify", estimate.direction, estimate.metric_clean,
                             estimate.metric_corrupted, forward=estimate.forward + exact.forward,
                             backward=estimate.backward, seconds=estimate.seconds + time.perf_counter() - start,
                             forward_tokens=estimate.forward_tokens + exact.forward_tokens, scores=scores)
