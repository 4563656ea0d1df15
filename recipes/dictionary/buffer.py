"""A bounded shuffle buffer of activation rows: what a dictionary trains on, drawn at random from many batches.

Consecutive tokens of one document have correlated activations; training on them in order biases each step.
:class:`ActivationBuffer` keeps up to ``capacity`` rows (tokens), takes each new batch's rows and hands out
uniformly random rows from everything it holds, so a step mixes tokens from up to ``capacity / rows per batch``
batches (SAELens's mixing buffer and sparsify's shuffling do the same). Its memory is bounded whatever the token
budget: one tensor of ``capacity`` rows (more only if one batch is larger), allocated by the first batch and reused;
a draw copies the rows drawn and moves as many rows into their slots, never the whole buffer.
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
        #: Rows ``[allocated, width]``; the first ``len(self)`` are held.
        self.storage: torch.Tensor | None = None
        self.held = 0

    def __len__(self) -> int:
        return self.held

    @property
    def rows(self) -> torch.Tensor | None:
        """The rows held ``[len(self), width]`` (a view of :attr:`storage`), ``None`` before the first push."""
        return None if self.storage is None else self.storage[:self.held]

    def restore(self, rows: torch.Tensor | None) -> None:
        """Hold exactly ``rows`` ``[n, width]`` (a checkpoint's :attr:`rows`; ``None``: empty), in a new storage of
        ``max(n, capacity)`` rows."""
        self.storage, self.held = None, 0
        if rows is not None:
            self.push(rows)

    def push(self, rows: torch.Tensor) -> None:
        """Add ``rows`` ``[n, width]`` (detached, copied in). The storage, ``capacity`` rows, grows only to hold more
        rows than that (a caller that pushes past :meth:`ready` without drawing, or a batch above ``capacity``).

        Raises:
            ValueError: ``rows`` of another width, dtype or device than the rows held.
        """
        rows = rows.detach()
        if self.storage is not None and (rows.shape[1:] != self.storage.shape[1:] or rows.dtype != self.storage.dtype
                                         or rows.device != self.storage.device):
            raise ValueError(f"rows {tuple(rows.shape)} {rows.dtype} on {rows.device} do not fit the buffer's "
                             f"{tuple(self.storage.shape)} {self.storage.dtype} on {self.storage.device}")
        needed = self.held + rows.shape[0]
        if self.storage is None or needed > self.storage.shape[0]:
            grown = rows.new_empty((max(needed, self.capacity), *rows.shape[1:]))
            if self.storage is not None:
                grown[:self.held] = self.storage[:self.held]
            self.storage = grown
        self.storage[self.held:needed] = rows
        self.held = needed

    def ready(self, count: int) -> bool:
        """Whether :meth:`pop` of ``count`` rows keeps the buffer mixing: it holds ``capacity`` rows or more."""
        return len(self) >= max(self.capacity, count)

    def pop(self, count: int) -> torch.Tensor:
        """Remove and return ``count`` rows drawn uniformly without replacement, ``[count, width]``; the rows held
        last move into the slots drawn.

        Raises:
            ValueError: fewer than ``count`` rows are held.
        """
        if self.storage is None or len(self) < count:
            raise ValueError(f"the activation buffer holds {len(self)} rows, fewer than the {count} asked for")
        taken = torch.randperm(self.held, generator=self.generator)[:count]
        out = self.storage[taken.to(self.storage.device)]
        left = self.held - count
        is_taken = torch.zeros(self.held, dtype=torch.bool)
        is_taken[taken] = True
        holes = taken[taken < left]                             # slots drawn among those that stay held
        movers = torch.arange(left, self.held)[~is_taken[left:]]  # rows past the end that were not drawn
        if holes.numel():
            self.storage[holes.to(self.storage.device)] = self.storage[movers.to(self.storage.device)]
        self.held = left
        return out
