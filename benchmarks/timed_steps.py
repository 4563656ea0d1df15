"""Timed optimizer steps with their memory, measured the same way on both sides of a peer comparison.

No project imports (like benchmarks/peak_rss.py), so that a side running in a peer's virtualenv (e.g.
benchmarks/pyreft_side.py in pyreft's) times and measures its steps with this very code.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TypeVar

import torch

from benchmarks.peak_rss import peak_mib, reset_peak, resident_mib

T = TypeVar("T")


@dataclass
class TimedSteps:
    """Per step: ``losses`` (the loss's float), ``seconds`` and ``cpu_seconds`` (wall and process CPU time from the
    forward pass through ``optimizer.step()``); ``resident_mib_before`` the resident memory before the first step,
    ``peak_mib`` its peak during the steps (MiB)."""

    losses: list[float]
    seconds: list[float]
    cpu_seconds: list[float]
    resident_mib_before: float
    peak_mib: float


def median(values: list[float]) -> float:
    """The upper median (the middle element of the sorted values)."""
    return sorted(values)[len(values) // 2]


def timed_steps(optimizer: torch.optim.Optimizer, batches: Iterable[T],
                loss_of: Callable[[T], torch.Tensor]) -> TimedSteps:
    """One step per batch: ``loss_of(batch)`` (a scalar), backward, ``optimizer.step()``; garbage collected and the
    memory peak reset before the first."""
    gc.collect()
    before = resident_mib()
    reset_peak()
    losses, seconds, cpu_seconds = [], [], []
    for batch in batches:
        start, cpu = time.perf_counter(), time.process_time()
        loss = loss_of(batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        seconds.append(time.perf_counter() - start)
        cpu_seconds.append(time.process_time() - cpu)
        losses.append(float(loss.detach()))
    return TimedSteps(losses, seconds, cpu_seconds, before, peak_mib())
