"""A causal trace on disk: ``trace.json`` and one heatmap ``trace_<kind>.png`` per kind, each written atomically."""

from __future__ import annotations

import io
import json
from pathlib import Path

from gradpatch.files.atomic import atomic_write_bytes, atomic_write_text

from .plot import plot_trace
from .result import TraceResult

__all__ = ["save_trace"]


def save_trace(result: TraceResult, out_dir: str | Path, *, model_name: str = "") -> dict[str, Path]:
    """Write ``out_dir/trace.json`` and one heatmap ``out_dir/trace_<kind>.png`` per traced kind.

    Each file goes to a temporary file first and is renamed into place
    (:func:`gradpatch.files.atomic.atomic_write_bytes`), so an interrupted run never leaves half a file.

    Args:
        result: a :class:`~editors.causal_trace.TraceResult`.
        out_dir: folder (created if missing).
        model_name: shown in the x-axis label of the heatmaps.

    Returns:
        ``{"json": path, "<kind>": png path, ...}``.

    Raises:
        OSError: the folder cannot be written.
        ImportError: matplotlib is not installed (``pip install matplotlib``).
    """
    out = Path(out_dir)
    written: dict[str, Path] = {"json": atomic_write_text(out / "trace.json", json.dumps(result.to_dict(), indent=1))}
    for kind in result.kinds:
        buffer = io.BytesIO()
        plot_trace(result, kind, model_name=model_name).savefig(buffer, format="png", bbox_inches="tight")
        written[kind] = atomic_write_bytes(out / f"trace_{kind}.png", buffer.getvalue())
    return written
