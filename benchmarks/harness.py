"""Peak resident memory of a stretch of a process (Linux): the kernel's high-water mark (``VmHWM``) reset before it.

No project imports, so that both sides of a peer comparison (e.g. benchmarks/pyreft_side.py in pyreft's virtualenv)
measure the same way: ``reset_peak()`` before the stretch, ``peak_mib()`` after it; ``resident_mib()`` is the
resident memory now (``VmRSS``). Writing ``5`` to ``/proc/self/clear_refs`` resets the high-water mark to the current
resident size (Linux ≥ 4.0, proc(5)).
"""

from __future__ import annotations

import re
from pathlib import Path

_STATUS = Path("/proc/self/status")


def _status_kib(field: str) -> int:
    match = re.search(rf"^{field}:\s+(\d+) kB", _STATUS.read_text(), re.MULTILINE)
    if match is None:
        raise RuntimeError(f"{_STATUS} has no {field} line: peak memory needs Linux's procfs")
    return int(match.group(1))


def reset_peak() -> None:
    """Reset the process's peak resident size (``VmHWM``) to its current resident size."""
    Path("/proc/self/clear_refs").write_text("5")


def peak_mib() -> float:
    """The peak resident size (MiB) since the last :func:`reset_peak` (or since the process started)."""
    return _status_kib("VmHWM") / 1024


def resident_mib() -> float:
    """The resident size now (MiB)."""
    return _status_kib("VmRSS") / 1024
