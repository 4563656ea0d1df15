"""At most N feature nodes: circuit-tracer's ``max_feature_nodes``, the features of greatest influence on the logits,
chosen while the rows are computed so that only the chosen features' rows are.

circuit-tracer (0.5.0, ``attribution.attribute._run_attribution``, phase 4) computes the logit rows first, then visits
features in rounds: each round ranks the unvisited features by their influence on the logits through the rows
computed so far (``graph.compute_partial_influences``: w Â_r + w Â_r² + … with Â_r = |A| row-normalised over the
rows computed, the logits' rows first, then the features' in visiting order), takes the next ``update_interval ·
batch_size`` of them (4 · batch_size by default), and computes their rows; it stops after ``max_feature_nodes``
features. The graph keeps the visited features, in their original order; the columns of the others are dropped, so
their contributions to the kept nodes leave the graph (they join the targets' biases,
:mod:`gradpatch.circuits.complete`).

:func:`feature_rounds` is those rounds; :func:`~gradpatch.circuits.attribute.attribute` computes each round's rows
before asking for the next.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from .prune import compute_influence, normalize_matrix

__all__ = ["feature_rounds"]


def feature_rounds(rows: torch.Tensor, logit_nodes: torch.Tensor, weights: torch.Tensor, n_features: int,
                   round_size: int) -> Iterator[torch.Tensor]:
    """The features to visit, one round at a time (module docstring): each round's feature indices
    ``[≤ round_size]``, in visiting order; before the next round the caller writes their rows into ``rows``.

    Args:
        rows: ``[limit + n_logits, n]``: row ``limit + j`` holds logit node j's row (filled before the first round),
            row i < limit the row of the i-th feature visited (filled by the caller after each round); ``limit`` =
            ``rows.shape[0] - n_logits`` features are visited in all. The features' node indices are
            0..``n_features`` − 1.
        logit_nodes: the logit nodes' indices ``[n_logits]``.
        weights: w ``[n]``, each logit node's probability.
        n_features: the active features to choose from.
        round_size: features per round, ``update_interval · batch_size`` (circuit-tracer's 4 · 512 by default).

    Yields:
        Feature indices (node indices) ``[k]`` of the next round. With ``limit == n_features`` one round of every
        feature in order (no ranking needed, as circuit-tracer does).
    """
    limit = rows.shape[0] - len(logit_nodes)
    if limit >= n_features:
        yield torch.arange(n_features)
        return
    order = torch.zeros(limit, dtype=torch.long)
    visited = torch.zeros(n_features, dtype=torch.bool)
    done = 0
    while done < limit:
        known = normalize_matrix(torch.cat([rows[limit:], rows[:done]]), inplace=True)
        influence = compute_influence(known, weights, torch.cat([logit_nodes, order[:done]]))[:n_features]
        del known
        rank = torch.argsort(influence, descending=True)
        pending = rank[~visited[rank]][:min(round_size, limit - done)]
        yield pending
        visited[pending] = True
        order[done:done + len(pending)] = pending
        done += len(pending)
