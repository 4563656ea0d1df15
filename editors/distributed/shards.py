"""Which facts a process works on, and the gathering of per-fact results onto every process.

A batch edit's per-fact work — the keys behind the context prefixes (MEMIT, Meng et al. 2023, arXiv 2210.07229, eq. 3
keys; eq. 14's ``K``) and the value search of each fact's ``δ`` (section 4.3, the batched search of
:func:`editors.value.batch_search.optimize_values`) — is independent across facts: one fact's keys and ``δ`` depend
only on that fact (each ``δ`` row has its own loss, Adam state and early stop). Split by facts over ``W`` ranks, each
rank does ``1/W`` of it; the rows are then gathered in request order on every rank, and every rank solves the same
closed form (the update itself is a few ``d_in × d_in`` solves, cheap beside the passes).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

from ..errors import EditError

T = TypeVar("T")


class FactShards:
    """One process holding every fact: the default of :class:`editors.MEMIT` (``rank`` 0 of ``world_size`` 1)."""

    rank: int = 0
    world_size: int = 1

    def span(self, n: int) -> range:
        """This rank's facts: a contiguous block of ``range(n)``; the blocks of the ranks differ in size by at most one
        and follow each other in rank order.

        Raises:
            EditError: fewer facts than ranks (a rank would have none).
        """
        if n < self.world_size:
            raise EditError(f"{n} facts for {self.world_size} processes: every process needs at least one fact; "
                            f"start at most {n} processes or edit more facts at once")
        per, extra = divmod(n, self.world_size)
        start = self.rank * per + min(self.rank, extra)
        return range(start, start + per + (1 if self.rank < extra else 0))

    def collect(self, compute: Callable[[], Sequence[T]], n: int) -> list[T]:
        """``compute()`` — this rank's items, one per fact of its :meth:`span`, in order — run here and gathered from
        every rank in rank order: ``n`` items, the same list on every rank (with several processes, tensors come back
        on the CPU). An error on one rank is raised on every rank, so none is left waiting in the gather.

        Raises:
            EditError: the items do not add up to ``n`` (ranks given other requests), or another rank failed.
            Whatever ``compute`` raises, on the rank where it failed.
        """
        items = list(compute())
        if len(items) != n:
            raise EditError(f"gathered {len(items)} facts, expected {n}")
        return items

    def agree(self, value: Any, what: str) -> None:
        """Check that every rank holds the same ``value`` (JSON-serialisable), before any work.

        Raises:
            EditError: a rank differs (the message names the ranks and ``what``, which should say how to fix it). One
                process has nothing to compare.
        """


class TorchDistributedShards(FactShards):
    """The ranks of an initialised ``torch.distributed`` process group (started by Lightning's DDP launcher, torchrun
    or SLURM; gloo on CPUs, NCCL on GPUs). Gathers use ``all_gather_object`` (in memory, between the processes).

    Args:
        group: the process group (default: the world).

    Raises:
        EditError: ``torch.distributed`` is not initialised (start the processes first).
    """

    def __init__(self, group: Any = None) -> None:
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            raise EditError("torch.distributed is not initialised: start the processes with Lightning "
                            "(recipes.run_distributed_edit) or torchrun before splitting facts across them")
        self.group = group
        self.rank = torch.distributed.get_rank(group)
        self.world_size = torch.distributed.get_world_size(group)

    def collect(self, compute: Callable[[], Sequence[T]], n: int) -> list[T]:
        error: Exception | None = None
        try:
            local: list[Any] = [_to_cpu(item) for item in compute()]
        except Exception as caught:  # noqa: BLE001 (re-raised below, after the other ranks learn of it)
            local, error = [], caught
        parts: list[Any] = [None] * self.world_size
        torch.distributed.all_gather_object(parts, (local, None if error is None else f"{type(error).__name__}: "
                                                    f"{error}"), group=self.group)
        if error is not None:
            raise error
        failed = [f"process {rank}: {message}" for rank, (_, message) in enumerate(parts) if message is not None]
        if failed:
            raise EditError(f"another process failed, so this one stops too ({'; '.join(failed)})")
        items = [item for part, _ in parts for item in part]
        if len(items) != n:
            raise EditError(f"the {self.world_size} processes gathered {len(items)} facts, expected {n}: they were "
                            f"given different requests; give every process the same list")
        return items

    def agree(self, value: Any, what: str) -> None:
        digest = hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()
        digests: list[Any] = [None] * self.world_size
        torch.distributed.all_gather_object(digests, digest, group=self.group)
        differ = [rank for rank, other in enumerate(digests) if other != digests[0]]
        if differ:
            raise EditError(f"processes {differ} hold other {what} than process 0")


def _to_cpu(item: Any) -> Any:
    """``item`` with every tensor (also inside tuples, lists and dataclasses) moved to the CPU."""
    if isinstance(item, torch.Tensor):
        return item.detach().cpu()
    if isinstance(item, (tuple, list)):
        return type(item)(_to_cpu(x) for x in item)
    if dataclasses.is_dataclass(item) and not isinstance(item, type):
        return dataclasses.replace(item, **{f.name: _to_cpu(getattr(item, f.name))
                                            for f in dataclasses.fields(item) if f.init})
    return item
