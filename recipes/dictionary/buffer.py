"""A bounded shuffle buffer of activation rows: what a dictionary trains on, drawn at random from many batches.

Consecutive tokens of one document have correlated activations; training on them in order biases each step.
:class:`ActivationBuffer` keeps up to ``capacity`` rows (tokens), takes each new batch's rows and hands out
uniformly random rows from everything it holds, so a step mixes tokens from up to ``capacity / rows per batch``
batches (SAELens's mixing buffer and sparsify's shuffling do the same). Its memory is bounded whatever the token
budget: ``capacity × width × bytes per element``.
"""

from __future__ import annotations

import torch

__all__ = ["ActivationBuffer"]


class ActivationBuffer:
    """Rows ``[n, width]`` in, random rows out.

    Args:
        capacity: the most rows held once warm (≥ 1).
        generator: the random generator of the draws (seeded for reproducible token order).

    Raises:
        ValueError: ``capacity`` < 1.
    """

    def __init__(self, capacity: int, generator: torch.Generator | None = None) -> None:
        if capacity < 1:
            raise ValueError(f"an activation buffer needs capacity >= 1 rows, got {capacity}")
        self.capacity = int(capacity)
        self.generator = generator
        self.rows: torch.Tensor | None = None

    def __len__(self) -> int:
        return 0 if self.rows is None else int(self.rows.shape[0])

    def push(self, rows: torch.Tensor) -> None:
        """Add ``rows`` ``[n, width]`` (detached)."""
        rows = rows.detach()
        self.rows = rows if self.rows is None else torch.cat([self.rows, rows])

    def ready(self, count: int) -> bool:
        """Whether :meth:`pop` of ``count`` rows keeps the buffer mixing: it holds ``capacity`` rows or more."""
        return len(self) >= max(self.capacity, count)

    def pop(self, count: int) -> torch.Tensor:
        """Remove and return ``count`` rows drawn uniformly without replacement, ``[count, width]``.

        Raises:
            ValueError: fewer than ``count`` rows are held.
        """
        if self.rows is None or len(self) < count:
            raise ValueError(f"the activation buffer holds {len(self)} rows, fewer than the {count} asked for")
        order = torch.randperm(len(self), generator=self.generator).to(self.rows.device)
        taken, kept = order[:count], order[count:]
        out, self.rows = self.rows[taken], self.rows[kept]
        return out
