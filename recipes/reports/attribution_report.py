"""An attribution run on disk: ``scores.json``, one heatmap PNG per node kind and a TensorBoard run, all published at
once (everything is written to a temporary sibling folder that is renamed into place only when complete).

Heatmaps: residual stream and MLP outputs as layers × positions, attention heads as heads × layers (summed over the
scored positions), NodePaths given directly as nodes × positions. Figures use matplotlib's Agg canvas (no pyplot).
"""

from __future__ import annotations

import io
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from gradpatch.attribution import AttributionResult

if TYPE_CHECKING:  # pragma: no cover
    from matplotlib.figure import Figure

__all__ = ["grid", "plot_faithfulness", "plot_grid", "publish_dir", "save_attribution"]


def grid(result: AttributionResult, kind: str) -> tuple[np.ndarray, list[str], list[str]]:
    """The scores of one node kind as a matrix with its row and column labels.

    Returns:
        ``(matrix, row_labels, column_labels)``: ``[layers, positions]`` for ``resid`` / ``mlp``, ``[heads, layers]``
        for ``heads`` (summed over positions), ``[nodes, positions]`` for ``node``.

    Raises:
        KeyError: ``result`` has no score of ``kind``.
    """
    scores = [s for s in result.scores if s.kind == kind]
    if not scores:
        raise KeyError(f"no scores of kind {kind!r}; kinds present: {sorted({s.kind for s in result.scores})}")
    if kind == "heads":
        layers = sorted({s.layer for s in scores if s.layer is not None})
        heads = sorted({s.head for s in scores if s.head is not None})
        matrix = np.zeros((len(heads), len(layers)))
        for s in scores:
            matrix[heads.index(s.head), layers.index(s.layer)] += s.score
        return matrix, [f"H{h}" for h in heads], [str(layer) for layer in layers]
    rows = sorted({s.node for s in scores}, key=lambda n: next(
        (s.layer if s.layer is not None else i) for i, s in enumerate(scores) if s.node == n))
    positions = sorted({s.position for s in scores})
    matrix = np.zeros((len(rows), len(positions)))
    for s in scores:
        matrix[rows.index(s.node), positions.index(s.position)] += s.score
    labels = [str(next(s.layer for s in scores if s.node == n)) if kind != "node" else n for n in rows]
    return matrix, labels, [str(p) for p in positions]


def plot_grid(result: AttributionResult, kind: str, *, model_name: str = "") -> "Figure":
    """A diverging heatmap of one kind's scores (red raises the metric, blue lowers it; symmetric colour scale).

    Raises:
        KeyError: no scores of ``kind``.
        ImportError: matplotlib is not installed (``pip install matplotlib``).
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as error:  # pragma: no cover - depends on the environment
        raise ImportError("Plotting attribution scores needs matplotlib: pip install matplotlib") from error
    matrix, rows, columns = grid(result, kind)
    fig = Figure(figsize=(max(4.0, 0.3 * len(columns) + 2.5), max(2.5, 0.22 * len(rows) + 1.2)), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    bound = max(float(np.abs(matrix).max()), 1e-9)
    mesh = ax.pcolormesh(matrix, cmap="RdBu_r", vmin=-bound, vmax=bound)
    ax.invert_yaxis()
    ax.set_yticks([0.5 + i for i in range(len(rows))])
    ax.set_yticklabels(rows, fontsize=6)
    ax.set_xticks([0.5 + i for i in range(len(columns))])
    ax.set_xticklabels(columns, fontsize=6)
    xlabel, ylabel = ("layer", "head") if kind == "heads" else ("position", "layer" if kind != "node" else "node")
    ax.set_xlabel(xlabel, fontsize=8)
    ax.set_ylabel(ylabel, fontsize=8)
    model = f" ({model_name})" if model_name else ""
    ax.set_title(f"{result.method} {result.direction}: {kind}{model}", fontsize=9)
    fig.colorbar(mesh, ax=ax).set_label("Δ metric", fontsize=8)
    return fig


def plot_faithfulness(result: AttributionResult, *, model_name: str = "") -> "Figure":
    """The faithfulness of the top-k-edge circuits against k (log scale), Hanna et al. 2024's curve.

    Raises:
        ImportError: matplotlib is not installed (``pip install matplotlib``).
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as error:  # pragma: no cover - depends on the environment
        raise ImportError("Plotting a faithfulness curve needs matplotlib: pip install matplotlib") from error
    fig = Figure(figsize=(5.0, 3.2), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    ks = [max(k, 1) for k, _ in result.faithfulness]
    ax.plot(ks, [f for _, f in result.faithfulness], marker="o")
    ax.set_xscale("log")
    ax.axhline(1.0, color="grey", linewidth=0.5)
    ax.axhline(0.0, color="grey", linewidth=0.5)
    ax.set_xlabel(f"edges in the circuit (of {len(result.edges)})", fontsize=8)
    ax.set_ylabel("faithfulness", fontsize=8)
    model = f" ({model_name})" if model_name else ""
    ax.set_title(f"{result.method}: top-k edge circuits{model}", fontsize=9)
    return fig


def staging_dir(out: Path) -> Path:
    """A new, empty folder ``.<name>.<random>.partial`` beside ``out`` (its parent created if missing), made with the
    user's umask (not ``tempfile.mkdtemp``'s 0700, which :func:`publish_dir` would rename into place), to write
    ``out``'s files into before :func:`publish_dir`."""
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.with_name(f".{out.name}.{uuid.uuid4().hex[:8]}.partial")
    staging.mkdir()
    return staging


def publish_dir(staging: Path, out: Path) -> None:
    """Move every entry of ``staging`` into ``out`` (created if missing) with renames, then remove ``staging``.

    A folder ``out`` that does not exist yet appears in one rename; an existing one gets each file renamed in (an
    entry of the same name is replaced).
    """
    if not out.exists():
        os.replace(staging, out)
        return
    for entry in staging.iterdir():
        target = out / entry.name
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        os.replace(entry, target)
    staging.rmdir()


def _tensorboard(result: AttributionResult, logdir: Path, kinds: list[str], model_name: str) -> None:
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(log_dir=str(logdir))
    try:
        for kind in kinds:
            writer.add_figure(f"attribution/{kind}", plot_grid(result, kind, model_name=model_name), close=True)
            writer.add_histogram(f"attribution/{kind}_scores", np.array([s.score for s in result.scores
                                                                         if s.kind == kind]))
        writer.add_scalar("attribution/metric_clean", result.metric_clean)
        writer.add_scalar("attribution/metric_corrupted", result.metric_corrupted)
        writer.add_scalar("attribution/seconds", result.seconds)
        for k, value in result.faithfulness:
            writer.add_scalar("attribution/faithfulness", value, k)
        summary = {key: value for key, value in result.to_dict().items() if key not in ("nodes", "edges")}
        writer.add_text("attribution/summary", "```\n" + json.dumps(summary, indent=1) + "\n```")
    finally:
        writer.close()


def save_attribution(result: AttributionResult, out_dir: str | Path, *, model_name: str = "",
                     extra: dict[str, Any] | None = None, tensorboard: bool = True) -> dict[str, Path]:
    """Write ``scores.json``, ``heatmap_<kind>.png`` per node kind (``faithfulness.png`` for edge methods) and a
    TensorBoard run ``tensorboard/`` to ``out_dir``, all at once: nothing appears in ``out_dir`` unless every file was
    written.

    Args:
        result: the run.
        out_dir: the folder (created if missing).
        model_name: shown in the heatmaps' titles.
        extra: more top-level keys for ``scores.json`` (e.g. the model and the prompts file).
        tensorboard: also write the TensorBoard run.

    Returns:
        ``{"json": path, "<kind>": png path, ..., "faithfulness": png path, "tensorboard": folder}`` (final paths).

    Raises:
        OSError: the folder cannot be written (``out_dir`` is left as it was).
        ImportError: matplotlib or tensorboard is not installed.
    """
    out = Path(out_dir)
    staging = staging_dir(out)
    try:
        payload = {**result.to_dict(), **(extra or {})}
        (staging / "scores.json").write_text(json.dumps(payload, indent=1), encoding="utf-8")
        written = {"json": out / "scores.json"}
        kinds = sorted({s.kind for s in result.scores})
        for kind in kinds:
            buffer = io.BytesIO()
            plot_grid(result, kind, model_name=model_name).savefig(buffer, format="png", bbox_inches="tight")
            (staging / f"heatmap_{kind}.png").write_bytes(buffer.getvalue())
            written[kind] = out / f"heatmap_{kind}.png"
        if result.faithfulness:
            buffer = io.BytesIO()
            plot_faithfulness(result, model_name=model_name).savefig(buffer, format="png", bbox_inches="tight")
            (staging / "faithfulness.png").write_bytes(buffer.getvalue())
            written["faithfulness"] = out / "faithfulness.png"
        if tensorboard:
            _tensorboard(result, staging / "tensorboard", kinds, model_name)
            written["tensorboard"] = out / "tensorboard"
        publish_dir(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return written
