"""The result of a causal trace: one heatmap per restored state kind (:class:`KindTrace`) and :class:`TraceResult`."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from .paths import ModelPaths

__all__ = ["KindTrace", "TraceResult"]


@dataclass
class KindTrace:
    """The restoration heatmap of one state kind.

    Attributes:
        kind: ``"hidden"``, ``"mlp"`` or ``"attn"``.
        window: layers restored at once (a cell at layer ``l`` restores :func:`layer_window` ``(l, window)``).
        node_pattern: the restored NodePath with ``{}`` for the layer, e.g. ``"model.layers_{}.mlp.output"``.
        scores: ``[num_layers, num_tokens]`` probability of the answer token (0..1) after restoring the state
            at (layer window, token), averaged over the noise samples.
    """

    kind: str
    window: int
    node_pattern: str
    scores: torch.Tensor

    def peak(self, token: int | None = None) -> tuple[int, int, float]:
        """``(layer, token, probability)`` of the highest cell (restricted to ``token`` when given)."""
        if token is not None:
            layer = int(self.scores[:, token].argmax())
            return layer, token, float(self.scores[layer, token])
        flat = int(self.scores.argmax())
        layer, tok = divmod(flat, self.scores.shape[1])
        return layer, tok, float(self.scores[layer, tok])


@dataclass
class TraceResult:
    """A causal trace of one prompt (paper section 2.1, Figure 1).

    Attributes:
        prompt: the full prompt text.
        subject: the corrupted subject.
        tokens: the decoded prompt tokens (heatmap labels), length ``num_tokens``.
        subject_range: ``(first, stop)`` token positions of the subject (noise goes on ``[first, stop)``).
        answer: the decoded answer token; ``answer_id`` its id.
        clean_prob: P(answer) on the clean prompt, at the last position.
        corrupted_prob: P(answer) with the subject corrupted, averaged over the noise samples (the baseline).
        noise_std: σ of the embeddings; ``noise_std_source`` says how it was measured
            (``"embedding_matrix"``, ``"corpus"`` or ``"given"``); the noise is ``N(0, (noise_level·σ)²)``.
        samples: number of noise draws; ``seed`` the seed of their generator.
        num_layers: blocks in the model.
        kinds: one :class:`KindTrace` per traced kind.
        seconds: wall time of the trace (forward passes included, model loading not).
    """

    prompt: str
    subject: str
    tokens: list[str]
    token_ids: list[int]
    subject_range: tuple[int, int]
    answer: str
    answer_id: int
    clean_prob: float
    corrupted_prob: float
    noise_std: float
    noise_std_source: str
    noise_level: float
    samples: int
    seed: int
    num_layers: int
    paths: ModelPaths
    kinds: dict[str, KindTrace] = field(default_factory=dict)
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict; each kind's ``scores`` is a nested list ``[num_layers][num_tokens]``."""
        kinds = {}
        last_subject = self.subject_range[1] - 1
        for name, trace in self.kinds.items():
            layer, tok, prob = trace.peak()
            sub_layer, _, sub_prob = trace.peak(last_subject)
            last_layer, _, last_prob = trace.peak(len(self.tokens) - 1)
            kinds[name] = {
                "window": trace.window,
                "node_pattern": trace.node_pattern,
                "scores": [[round(float(v), 7) for v in row] for row in trace.scores],
                "peak": {"layer": layer, "token": tok, "prob": prob},
                "peak_at_last_subject_token": {"layer": sub_layer, "prob": sub_prob},
                "peak_at_last_token": {"layer": last_layer, "prob": last_prob},
            }
        return {
            "prompt": self.prompt,
            "subject": self.subject,
            "tokens": self.tokens,
            "token_ids": self.token_ids,
            "subject_range": list(self.subject_range),
            "answer": self.answer,
            "answer_id": self.answer_id,
            "clean_prob": self.clean_prob,
            "corrupted_prob": self.corrupted_prob,
            "noise": {
                "std": self.noise_std,
                "std_source": self.noise_std_source,
                "level": self.noise_level,
                "scale": self.noise_level * self.noise_std,
                "samples": self.samples,
                "seed": self.seed,
            },
            "num_layers": self.num_layers,
            "paths": asdict(self.paths),
            "scores_layout": "scores[layer][token]: P(answer) after restoring that state, mean over noise samples",
            "kinds": kinds,
            "seconds": self.seconds,
        }


