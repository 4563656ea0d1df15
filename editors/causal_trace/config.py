"""What a causal trace restores and how it corrupts: :class:`TraceConfig` and its defaults.

This module imports nothing heavy (no torch), so the ``gradpatch trace`` command reads its defaults for ``--help``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["DEFAULT_WINDOWS", "KINDS", "TraceConfig"]

#: The state kinds that can be restored.
KINDS: tuple[str, ...] = ("hidden", "mlp", "attn")

#: Layers restored at once per kind (paper section 2.1: 10-layer windows for MLP and attention outputs).
DEFAULT_WINDOWS: dict[str, int] = {"hidden": 1, "mlp": 10, "attn": 10}


@dataclass(frozen=True)
class TraceConfig:
    """Settings of :func:`~editors.causal_trace.causal_trace` (Meng et al. 2022, arXiv 2202.05262, section 2.1).

    Attributes:
        kinds: which states to restore, among ``"hidden"``, ``"mlp"``, ``"attn"``.
        samples: noise draws averaged over (the paper uses 10).
        noise_level: noise standard deviation in units of the embeddings' σ (the paper's 3).
        noise_std: σ itself; ``None`` measures it over the embedding matrix
            (:func:`~editors.causal_trace.embedding_matrix_std`).
        noise_std_source: label recorded for a given ``noise_std`` (default ``"given"``).
        seed: seed of the noise generator (the draws are shared by all restorations).
        windows: layers restored at once per kind, merged over :data:`DEFAULT_WINDOWS` (hidden 1, mlp 10,
            attn 10); a cell at layer ``l`` restores the layers :func:`~editors.causal_trace.layer_window`
            ``(l, window, num_layers)``.
        batch_size: rows per forward pass (each row is one (layer, token, noise sample) restoration), at least 2.
        causal: the model attends only to earlier positions, so tokens before the subject are unaffected by the
            noise and restoring them gives exactly the corrupted baseline: those cells are filled in without a
            forward pass. Set ``False`` for models that attend to later positions.
    """

    kinds: tuple[str, ...] = KINDS
    samples: int = 10
    noise_level: float = 3.0
    noise_std: float | None = None
    noise_std_source: str | None = None
    seed: int = 1
    windows: dict[str, int] = field(default_factory=dict)
    batch_size: int = 256
    causal: bool = True

    def window(self, kind: str) -> int:
        """Layers restored at once for ``kind`` (``windows`` over :data:`DEFAULT_WINDOWS`)."""
        return self.windows.get(kind, DEFAULT_WINDOWS[kind])
