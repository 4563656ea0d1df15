"""Attribution results as records: one (node, position, head, score) per patched activation."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["AttributionResult", "EdgeScore", "NodeScore"]


@dataclass(frozen=True)
class NodeScore:
    """The change of the metric when one activation is patched (exact), or its estimate.

    Attributes:
        node: the NodePath.
        position: 0-based token position in the prompt.
        head: the attention head for ``"heads"`` nodes, ``None`` otherwise.
        score: metric(patched) − metric(base), in the metric's units (logits for the logit difference).
        kind: ``"resid"``, ``"heads"``, ``"mlp"`` or ``"node"``.
        layer: the block index, ``None`` for a NodePath given directly.
        exact: ``True`` where ``score`` is the measured effect of the patch (the exact sweep, or a unit an estimate
            ranked high and :func:`~gradpatch.attribution.verify.verify_top` patched), ``False`` for an estimate.
    """

    node: str
    position: int
    head: int | None
    score: float
    kind: str = "node"
    layer: int | None = None
    exact: bool = False


@dataclass(frozen=True)
class EdgeScore:
    """The (estimated) change of the metric when the edge ``upstream → downstream`` carries its corrupted value.

    Attributes:
        upstream: an upstream output (``"embed"``, ``"a{layer}.h{head}"``, ``"m{layer}"``).
        downstream: a downstream input (``"a{layer}.h{head}.{q|k|v}"``, ``"m{layer}"``, ``"logits"``).
        score: summed over positions, in the metric's units.
    """

    upstream: str
    downstream: str
    score: float


@dataclass
class AttributionResult:
    """What one attribution run found.

    Attributes:
        method: ``"exact"``, ``"atp"``, ``"atp-ig"``, ``"atp-star"``, ``"eap"``, ``"eap-ig"``; ``"+verify"`` appended
            where the estimate's top units were then patched exactly.
        direction: ``"noise"`` (clean run, corrupted values patched in) or ``"denoise"`` (the reverse).
        metric_clean: the metric on the clean prompts.
        metric_corrupted: the metric on the corrupted prompts.
        forward: forward passes run (a batched pass counts once).
        backward: backward passes run.
        seconds: wall-clock time of the run.
        forward_tokens: the exact sweep's token count: each forward pass counts the tokens of its call (``seq`` for
            a whole-prompt pass, ``seq - p`` for a pass on the KV cache of the first ``p`` tokens); 0 for the other
            methods (not counted).
        scores: one record per node unit.
        edges: one record per edge (edge methods only).
        faithfulness: ``[(k, faithfulness)]`` of the top-k-edge circuits (edge methods only).
    """

    method: str
    direction: str
    metric_clean: float
    metric_corrupted: float
    forward: int = 0
    backward: int = 0
    seconds: float = 0.0
    forward_tokens: int = 0
    scores: list[NodeScore] = field(default_factory=list)
    edges: list[EdgeScore] = field(default_factory=list)
    faithfulness: list[tuple[int, float]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """The ``scores.json`` layout: method, direction, metric {clean, corrupted}, passes {forward, backward},
        seconds, nodes [{node, position, head, score, kind, layer, exact}], and for edge methods edges and
        faithfulness."""
        out: dict[str, Any] = {
            "method": self.method, "direction": self.direction,
            "metric": {"clean": self.metric_clean, "corrupted": self.metric_corrupted},
            "passes": {"forward": self.forward, "backward": self.backward}, "seconds": self.seconds,
            "nodes": [asdict(score) for score in self.scores],
        }
        if self.edges:
            out["edges"] = [asdict(edge) for edge in self.edges]
            out["faithfulness"] = [{"k": k, "faithfulness": f} for k, f in self.faithfulness]
        return out

    def score_map(self) -> dict[tuple[str, int, int | None], float]:
        """``(node, position, head) -> score``."""
        return {(s.node, s.position, s.head): s.score for s in self.scores}
