"""A causal trace in TensorBoard: heatmap images, the clean and corrupted probabilities, the JSON summary."""

from __future__ import annotations

import json
from typing import Any

from editors.causal_trace import TraceResult, plot_trace

__all__ = ["log_trace_to_tensorboard"]


def log_trace_to_tensorboard(
    result: TraceResult, writer: Any, *, tag: str = "causal_trace", step: int = 0, model_name: str = ""
) -> list[str]:
    """Add a trace's heatmaps (images) and probabilities (scalars) to a TensorBoard run.

    Args:
        result: a :class:`~editors.causal_trace.TraceResult`.
        writer: a ``torch.utils.tensorboard.SummaryWriter`` (left open) or a log directory (a writer is opened
            there and closed).
        tag: tag prefix; images go to ``{tag}/{kind}``, scalars to ``{tag}/clean_prob`` and
            ``{tag}/corrupted_prob``, the JSON summary (without score grids) to ``{tag}/summary`` as text.
        step: the global step recorded.
        model_name: shown in the heatmaps' x-axis label.

    Returns:
        The image tags written.

    Raises:
        ImportError: tensorboard is not installed (``pip install tensorboard``).
    """
    own = not hasattr(writer, "add_figure")
    if own:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as error:  # pragma: no cover - depends on the environment
            raise ImportError("Logging a trace to TensorBoard needs tensorboard: pip install tensorboard") from error
        writer = SummaryWriter(log_dir=str(writer))
    tags = []
    try:
        for kind in result.kinds:
            fig = plot_trace(result, kind, model_name=model_name)
            writer.add_figure(f"{tag}/{kind}", fig, global_step=step, close=True)
            tags.append(f"{tag}/{kind}")
        writer.add_scalar(f"{tag}/clean_prob", result.clean_prob, step)
        writer.add_scalar(f"{tag}/corrupted_prob", result.corrupted_prob, step)
        summary = result.to_dict()
        for kind in summary["kinds"].values():
            kind.pop("scores")
        writer.add_text(f"{tag}/summary", "```\n" + json.dumps(summary, indent=1) + "\n```", step)
        writer.flush()
    finally:
        if own:
            writer.close()
    return tags
