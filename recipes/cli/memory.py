"""Memory for the commands: a size given on the command line (``--max-memory 8GiB``) and the peak memory of a stretch
of work (:class:`PeakMemory`): on the CPU the process's resident-memory high-water mark (Linux's ``VmHWM``, reset
at the start through ``/proc/self/clear_refs``, proc(5); where that cannot be reset, ``getrusage``'s ``ru_maxrss``,
the process's peak since it started), on a CUDA device ``torch.cuda.max_memory_allocated``.
"""

from __future__ import annotations

import gc
import re
import resource
from pathlib import Path
from typing import Any

__all__ = ["PeakMemory", "parse_bytes"]

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12,
          "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*")
_STATUS = Path("/proc/self/status")


def parse_bytes(text: str) -> int:
    """Bytes of a size such as ``8GiB``, ``512MiB``, ``1.5G`` (decimal: k, M, G, T with or without B; binary: KiB,
    MiB, GiB, TiB) or a plain number of bytes.

    Raises:
        ValueError: another form, or a size below 1 byte; the message gives examples.
    """
    match = _SIZE.fullmatch(text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS or float(match.group(1)) * _UNITS[unit] < 1:
        raise ValueError(f"{text!r} is not a size: write e.g. 8GiB, 512MiB, 1.5G or a number of bytes")
    return int(float(match.group(1)) * _UNITS[unit])


def _status_bytes(field: str) -> int | None:
    """A ``/proc/self/status`` memory field in bytes, ``None`` where there is none (not Linux)."""
    try:
        match = re.search(rf"^{field}:\s+(\d+) kB", _STATUS.read_text(), re.MULTILINE)
    except OSError:
        return None
    return int(match.group(1)) * 1024 if match else None


class PeakMemory:
    """The peak memory while the block runs (module docstring), in bytes.

    Args:
        device: the device the work runs on (``"cpu"``, ``"cuda"``, ``"cuda:1"``...).

    Attributes:
        kind: ``"rss"`` (the resident high-water mark over the block), ``"process_max_rss"`` (the process's peak
            since it started: the high-water mark could not be reset) or ``"cuda_max_memory_allocated"``.
        before: the memory when the block started (resident or allocated bytes).
        peak: the peak during the block (bytes; with ``"process_max_rss"``, since the process started).
    """

    def __init__(self, device: str) -> None:
        self.device = device
        self.kind = "cuda_max_memory_allocated" if device.startswith("cuda") else "rss"
        self.before = self.peak = 0

    def __enter__(self) -> PeakMemory:
        gc.collect()
        if self.kind.startswith("cuda"):
            import torch

            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.before = torch.cuda.memory_allocated(self.device)
            return self
        try:
            Path("/proc/self/clear_refs").write_text("5")
        except OSError:
            self.kind = "process_max_rss"
        self.before = _status_bytes("VmRSS") or 0
        return self

    def __exit__(self, *exc: object) -> None:
        if self.kind.startswith("cuda"):
            import torch

            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device)
        elif self.kind == "rss" and _status_bytes("VmHWM") is not None:
            self.peak = int(_status_bytes("VmHWM") or 0)
        else:
            self.kind = "process_max_rss"
            self.peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    def record(self) -> dict[str, Any]:
        """The JSON of the measurement: ``kind``, ``before_bytes``, ``peak_bytes``, ``peak_gib``."""
        return {"kind": self.kind, "before_bytes": self.before, "peak_bytes": self.peak,
                "peak_gib": round(self.peak / 2**30, 3)}
