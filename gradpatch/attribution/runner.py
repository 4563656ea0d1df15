"""Forward passes of an attribution run: last-position logits, patched, counted."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Callable

import torch

from ..layouts import last_position_cut, logits_input
from ..patchable_graph import PatchableGraph
from ..patches import Patch, ProbePatch
from .errors import AttributionError
from .metrics import Metric, check_metric, check_scalar
from .nodes import Node
from .prompts import PromptBatch

__all__ = ["DIRECTIONS", "Progress", "Runner", "check_positions"]

#: ``"noise"``: the clean run with corrupted values patched in; ``"denoise"``: the corrupted run with clean values.
DIRECTIONS = ("noise", "denoise")

#: ``progress(done, total)``, called as units are scored.
Progress = Callable[[int, int], None]

def check_positions(positions: Sequence[int] | None, length: int) -> list[int]:
    """``positions`` (default: every position) as a list of 0-based positions of a ``length``-token prompt.

    Raises:
        AttributionError: a position outside ``[0, length)``.
    """
    chosen = list(range(length)) if positions is None else [int(p) for p in positions]
    bad = [p for p in chosen if not 0 <= p < length]
    if bad or not chosen:
        raise AttributionError(f"positions {bad or chosen} are not positions of the {length}-token prompts; give "
                               f"0-based positions in [0, {length})")
    return chosen


class Runner:
    """Runs ``pg`` on token ids with patches and returns the last position's logits ``[rows, vocab]``.

    Args:
        pg: the model's graph (a ``transformers`` causal LM whose output has ``.logits``, or one returning logits).
        batch: the prompt pairs.
        metric: ``metric(logits, batch) -> scalar``; checked on zero logits before any forward.
        direction: ``"noise"`` or ``"denoise"``.
        forward_kwargs: keyword arguments of every call (those ``pg`` was built with, e.g. ``use_cache=False``).

    Raises:
        AttributionError: an unknown direction, a metric that is not a scalar.
    """

    def __init__(self, pg: PatchableGraph, batch: PromptBatch, metric: Metric, direction: str = "noise",
                 forward_kwargs: Mapping[str, Any] | None = None) -> None:
        if direction not in DIRECTIONS:
            raise AttributionError(f"direction {direction!r}: use 'noise' (patch corrupted values into the clean run) "
                                   f"or 'denoise' (clean values into the corrupted run)")
        self.pg = pg
        self.batch = batch
        self.metric = metric
        self.direction = direction
        self.forward_kwargs = dict(forward_kwargs or {})
        self.forwards = 0
        self.backwards = 0
        self.forward_tokens = 0
        #: The unembedding's input, where only the last position goes on (the metrics read the last position).
        self.cut = logits_input(pg)
        vocab = getattr(pg.config, "vocab_size", None) if pg.config is not None else None
        check_metric(metric, batch, vocab)

    @property
    def base_ids(self) -> torch.Tensor:
        """``[batch, seq]``: the run that is patched (clean for noising)."""
        return self.batch.clean if self.direction == "noise" else self.batch.corrupted

    @property
    def source_ids(self) -> torch.Tensor:
        """``[batch, seq]``: the run whose values are patched in (corrupted for noising)."""
        return self.batch.corrupted if self.direction == "noise" else self.batch.clean

    def logits(self, ids: torch.Tensor, patches: Mapping[str, Patch | list[Patch]] | None = None,
               call_kwargs: Mapping[str, Any] | None = None) -> torch.Tensor:
        """Last-position logits ``[rows, vocab]`` of ``ids`` ``[rows, seq]`` with ``patches`` applied (counted as one
        forward pass of ``seq`` tokens in :attr:`forward_tokens`); ``call_kwargs`` add to or replace the
        ``forward_kwargs`` of this call (a KV cache, say)."""
        patch_map: dict[str, Any] = dict(patches or {})
        if self.cut is not None:
            cut = last_position_cut()
            existing = patch_map.get(self.cut)
            before = [*existing] if isinstance(existing, list) else [existing] if existing else []
            patch_map[self.cut] = [*before, cut]
        with self.pg.patch(patch_map):
            output = self.pg(ids, **{**self.forward_kwargs, **(call_kwargs or {})})
        self.forwards += 1
        self.forward_tokens += int(ids.shape[-1])
        logits = output.logits if hasattr(output, "logits") else output
        return logits[:, -1]

    def value(self, logits: torch.Tensor) -> torch.Tensor:
        """The metric of ``logits`` ``[batch, vocab]`` as a 0-d tensor.

        Raises:
            AttributionError: the metric is not a scalar.
        """
        return check_scalar(self.metric(logits, self.batch))

    def record(self, ids: torch.Tensor, nodes: Sequence[Node]) -> tuple[dict[str, torch.Tensor], float]:
        """Run ``ids`` without gradients, recording every node's value as ``[batch, seq, width]``
        (:meth:`Node.flat`); returns them and the metric."""
        probes = {node.path: ProbePatch() for node in nodes}
        with torch.no_grad():
            logits = self.logits(ids, probes)
            value = float(self.value(logits))
        return {node.path: node.flat(probes[node.path].activation) for node in nodes}, value
