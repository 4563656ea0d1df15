"""Progress of long loops (statistics, causal traces, evaluations): one tqdm bar behind one interface.

A long-running function takes ``progress: bool`` (show a bar) or, where a caller drives its own display, a
:data:`Progress` callback ``(done, total)``; :class:`ProgressBar` is both the bar and such a callback, and writes
per-item report lines above the bar (:meth:`ProgressBar.note`) so they do not break it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import TracebackType
from typing import Any

__all__ = ["Progress", "ProgressBar"]

#: ``(done, total)`` after each unit of work, e.g. ``(rows_done, rows_total)`` of a causal trace.
Progress = Callable[[int, int], None]


class ProgressBar:
    """A tqdm progress bar on stderr, usable as a :data:`Progress` callback and as a context manager.

    Args:
        desc: the label, e.g. ``"second moment model.layers_3.mlp.down_proj"``.
        unit: what is counted (``"doc"``, ``"case"``, ``"row"``).
        total: the number of units (0 when a callback sets it later).
        enabled: ``False`` shows no bar; :meth:`note` lines are still printed (to stdout).
    """

    def __init__(self, desc: str, *, unit: str = "it", total: int = 0, enabled: bool = True) -> None:
        from tqdm.auto import tqdm

        self._tqdm = tqdm
        self._bar: Any = tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, disable=not enabled)

    def __call__(self, done: int, total: int) -> None:
        """Move the bar to ``done`` of ``total`` units (the :data:`Progress` callback)."""
        self._bar.total = total
        self._bar.update(done - self._bar.n)

    def advance(self, units: int = 1) -> None:
        """Count ``units`` more units done."""
        self._bar.update(units)

    def note(self, line: str) -> None:
        """Print a report line (to stdout) above the bar, e.g. one evaluated case's scores."""
        self._tqdm.write(line, file=sys.stdout)

    def close(self) -> None:
        """Close the bar (its last state stays on screen)."""
        self._bar.close()

    def __enter__(self) -> "ProgressBar":
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.close()
