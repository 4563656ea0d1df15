"""Heatmaps of causal traces, drawn like Figure 1 of Meng et al. 2022 (arXiv 2202.05262, section 2.1).

Tokens run down the vertical axis (subject tokens marked ``*``), layers along the horizontal axis, colour is the
probability of the answer token after restoring the state; the colour scale starts at the corrupted baseline.
Figures are built on matplotlib's Agg canvas directly (no pyplot state, no display needed).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from matplotlib.figure import Figure

    from .result import TraceResult

__all__ = ["CMAPS", "plot_trace", "token_labels"]

#: Colour map per kind, as in the paper's figures.
CMAPS: dict[str, str] = {"hidden": "Purples", "mlp": "Greens", "attn": "Reds"}

_KIND_NAMES: dict[str, str] = {"hidden": "state", "mlp": "MLP", "attn": "Attn"}


def token_labels(result: "TraceResult") -> list[str]:
    """Tick labels of the prompt tokens: the decoded text (``repr`` quotes when blank), ``*`` after subject tokens."""
    s0, s1 = result.subject_range
    labels = []
    for i, token in enumerate(result.tokens):
        label = token if token.strip() else repr(token)
        labels.append(f"{label}*" if s0 <= i < s1 else label)
    return labels


def plot_trace(result: "TraceResult", kind: str, *, model_name: str = "") -> "Figure":
    """Draw one kind's heatmap.

    Args:
        result: a :class:`~editors.causal_trace.TraceResult`.
        kind: ``"hidden"``, ``"mlp"`` or ``"attn"`` (must be in ``result.kinds``).
        model_name: named in the x-axis label (e.g. ``"SmolLM2-135M"``).

    Returns:
        A ``matplotlib.figure.Figure`` with an Agg canvas (``fig.savefig(path)`` writes a PNG).

    Raises:
        KeyError: ``kind`` was not traced (the message lists those that were).
        ImportError: matplotlib is not installed (``pip install matplotlib``).
    """
    if kind not in result.kinds:
        raise KeyError(f"Kind {kind!r} was not traced; traced kinds: {', '.join(result.kinds) or '(none)'}")
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as error:  # pragma: no cover - depends on the environment
        raise ImportError("Plotting a trace needs matplotlib: pip install matplotlib") from error

    trace = result.kinds[kind]
    grid = trace.scores.detach().float().T.numpy()  # [tokens, layers]
    num_tokens, num_layers = grid.shape
    fig = Figure(figsize=(max(4.0, 0.16 * num_layers + 2.2), max(2.0, 0.28 * num_tokens + 1.0)), dpi=150)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    vmin = min(result.corrupted_prob, float(grid.min()))
    vmax = max(float(grid.max()), vmin + 1e-9)
    mesh = ax.pcolormesh(grid, cmap=CMAPS.get(kind, "Purples"), vmin=vmin, vmax=vmax)
    ax.invert_yaxis()
    ax.set_yticks([0.5 + i for i in range(num_tokens)])
    ax.set_yticklabels(token_labels(result), fontsize=8)
    step = 5 if num_layers > 12 else 1
    ax.set_xticks([0.5 + i for i in range(0, num_layers, step)])
    ax.set_xticklabels([str(i) for i in range(0, num_layers, step)], fontsize=8)
    name = _KIND_NAMES.get(kind, kind)
    model = f" within {model_name}" if model_name else ""
    ax.set_title(f"Impact of restoring {name} after corrupted input", fontsize=9)
    if trace.window == 1:
        ax.set_xlabel(f"single restored layer{model}", fontsize=8)
    else:
        ax.set_xlabel(f"center of interval of {trace.window} restored {name} layers{model}", fontsize=8)
    colorbar = fig.colorbar(mesh, ax=ax)
    colorbar.ax.tick_params(labelsize=7)
    colorbar.ax.set_title(f"p({result.answer.strip()})", fontsize=8)
    fig.tight_layout()
    return fig

