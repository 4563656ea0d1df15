"""The edge graph of a Llama-style model and the forward pass that routes each edge separately.

Upstream outputs u write into the residual stream: the token embeddings, each attention head's contribution
z_h W_O[:, h] (its slice of ``o_proj``), each MLP's output. Downstream inputs v read it: each query head's query
input, each key/value head's key and value inputs, each MLP's input and the logits (the final norm's input). In the
model every v reads the same residual Σ_u z_u; :class:`EdgeForward` gives every v its own copy, x + δ_v, by
recomputing the normed projection per head (``norm(x + δ_v) W[h]``), so that

- with ``δ_v`` zero ``nn.Parameter``\\ s, the gradient of each is ∂M/∂input_v (EAP, Syed et al. 2023, section 3);
- with ``δ_v = Σ_u mask[u, v] (z_u^corrupted − z_u)`` an edge subset carries corrupted values, row block by row block
  (exact edge patching, circuits' faithfulness; Hanna et al. 2024, section 4).

Edge names: upstream ``"embed"``, ``"a{layer}.h{head}"``, ``"m{layer}"``; downstream ``"a{layer}.h{head}.q"``,
``"a{layer}.h{kv_head}.k"``, ``"a{layer}.h{kv_head}.v"``, ``"m{layer}"``, ``"logits"``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..errors import LayoutError
from ..layouts import LLAMA_LAYOUT, ModelLayout, count_layers, detect_layout, has_node
from ..patchable_graph import PatchableGraph
from ..patches import CustomPatch
from .errors import AttributionLayoutError

__all__ = ["Deltas", "EdgeForward", "EdgeGraph"]


def _block_nodes(layout: ModelLayout, layer: int | None) -> dict[str, str]:
    """The NodePaths the edge forward patches in block ``layer`` (``None``: the embeddings and the final norm's input)
    by role (``"embed"``, ``"logits"``; ``"attn_norm"``, ``"q"``, ``"k"``, ``"v"``, ``"heads"``, ``"mlp_norm"``,
    ``"mlp"``); empty where ``layout`` lacks a part (fused projections, no norms)."""
    if layout.projections is None or layout.attn_norm is None or layout.mlp_norm is None or layout.final_norm is None:
        return {}
    if layer is None:
        return {"embed": layout.embed, "logits": f"{layout.final_norm}.{layout.norm_input}"}
    block = layout.block(layer)
    paths = {"attn_norm": f"{block}.{layout.attn_norm}.{layout.norm_input}"}
    paths.update({part: f"{block}.{projection}.output" for part, projection in zip("qkv", layout.projections)})
    paths.update(heads=layout.path("heads", layer), mlp_norm=f"{block}.{layout.mlp_norm}.{layout.norm_input}",
                 mlp=layout.path("mlp", layer))
    return paths


@dataclass(frozen=True)
class EdgeGraph:
    """Sizes and names of a Llama-style model's edge graph.

    Attributes:
        layers, heads, kv_heads, head_dim, d_model: the model's sizes.
        layout: where the model keeps the embeddings, the blocks' norms and projections and the final norm (a family
            of the one layout table with separate query, key and value projections).
    """

    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    d_model: int
    layout: ModelLayout = LLAMA_LAYOUT

    @classmethod
    def of(cls, pg: PatchableGraph) -> "EdgeGraph":
        """The edge graph of ``pg``.

        Raises:
            AttributionLayoutError: ``pg`` is not a Llama-style graph (blocks with an attention norm, separate
                q/k/v projections, an MLP norm, and a final norm); the message names the NodePaths looked for.
        """
        try:
            layout = detect_layout(pg)
        except LayoutError as error:
            raise AttributionLayoutError(f"edge attribution needs a Llama-style graph: {error}") from None
        if layout.block_form != "sequential" or layout.post_norms or not layout.attn.startswith(
                layout.out_projection.rsplit(".", 1)[0] + "."):
            raise AttributionLayoutError(
                f"edge attribution needs a Llama-style graph, a sequential block whose attention adds its output "
                f"projection's output to the residual stream without a norm or multiplier; the {layout.family!r} "
                f"layout has a {layout.block_form} block{' with post-norms' if layout.post_norms else ''} adding "
                f"{layout.attn!r}: use node attribution (atp, exact_sweep) on this model")
        needed = {**_block_nodes(layout, None), **_block_nodes(layout, 0)}
        missing = [path for path in needed.values() if not has_node(pg, path)]
        if not needed or missing:
            raise AttributionLayoutError(
                f"edge attribution needs a Llama-style graph (blocks {layout.block(0)!r} with an attention norm, "
                f"separate q/k/v projections, an MLP norm, and a final norm); this graph lacks "
                f"{missing or 'separate q/k/v projections and norms (its layout fuses or lacks them)'}")
        config = pg.config
        layers = count_layers(pg, layout)
        heads, kv_heads = int(config.num_attention_heads), int(getattr(config, "num_key_value_heads", None)
                                                                    or config.num_attention_heads)
        d_model = int(config.hidden_size)
        head_dim = int(getattr(config, "head_dim", None) or d_model // heads)
        return cls(layers, heads, kv_heads, head_dim, d_model, layout)

    @property
    def per_layer_down(self) -> int:
        """Downstream inputs per layer: q heads, k heads, v heads, the MLP."""
        return self.heads + 2 * self.kv_heads + 1

    @property
    def n_up(self) -> int:
        """Number of upstream outputs."""
        return 1 + self.layers * (self.heads + 1)

    @property
    def n_down(self) -> int:
        """Number of downstream inputs."""
        return self.layers * self.per_layer_down + 1

    def upstream_names(self) -> list[str]:
        """Upstream names in index order: embed, then per layer its heads and its MLP."""
        names = ["embed"]
        for layer in range(self.layers):
            names += [f"a{layer}.h{h}" for h in range(self.heads)] + [f"m{layer}"]
        return names

    def downstream_names(self) -> list[str]:
        """Downstream names in index order: per layer q, k, v heads and the MLP, then the logits."""
        names = []
        for layer in range(self.layers):
            names += [f"a{layer}.h{h}.q" for h in range(self.heads)]
            names += [f"a{layer}.h{g}.{part}" for part in ("k", "v") for g in range(self.kv_heads)]
            names.append(f"m{layer}")
        return names + ["logits"]

    def reach(self) -> torch.Tensor:
        """``[n_up]`` → ``[n_down]`` allowed edges as a bool matrix ``[n_up, n_down]`` (upstream before downstream)."""
        allowed = torch.zeros(self.n_up, self.n_down, dtype=torch.bool)
        for layer in range(self.layers):
            first = layer * self.per_layer_down
            before_attention = 1 + layer * (self.heads + 1)
            allowed[:before_attention, first:first + self.per_layer_down - 1] = True
            allowed[:before_attention + self.heads, first + self.per_layer_down - 1] = True
        allowed[:, -1] = True
        return allowed


#: ``deltas(layer, part) -> [rows, seq, n, d_model]`` or ``None``: the δ of the downstream inputs of one part
#: (``"attn"``: q heads, k heads, v heads in order; ``"mlp"``; ``"logits"``: n = 1) given the upstream so far.
Deltas = Callable[[int | None, str, list[torch.Tensor]], torch.Tensor | None]


class EdgeForward:
    """The patches of one forward pass that records every upstream output and gives each downstream input its δ.

    Args:
        pg: the Llama-style graph.
        graph: its :class:`EdgeGraph`.
        deltas: the δ of each downstream input, from the upstream outputs of this pass so far (``None``: none).
        embeddings: replaces the token embeddings ``[rows or 1, seq, d_model]`` (EAP-IG's interpolated inputs).

    Attributes:
        upstream: after the pass, the upstream outputs ``[rows, seq, d_model]`` in index order.
    """

    def __init__(self, pg: PatchableGraph, graph: EdgeGraph, deltas: Deltas,
                 embeddings: torch.Tensor | None = None) -> None:
        self.pg, self.graph, self.deltas, self.embeddings = pg, graph, deltas, embeddings
        self.upstream: list[torch.Tensor] = []
        self._inputs: dict[int, torch.Tensor] = {}
        self._attn: dict[int, torch.Tensor | None] = {}

    def patches(self) -> dict[str, Any]:
        """The patch map of the pass."""
        ends = _block_nodes(self.graph.layout, None)
        patches: dict[str, Any] = {ends["embed"]: self._patch(self._embed), ends["logits"]: self._patch(self._logits)}
        for layer in range(self.graph.layers):
            paths = _block_nodes(self.graph.layout, layer)
            patches[paths["attn_norm"]] = self._patch(self._keep_input(layer))
            for index, part in enumerate("qkv"):
                patches[paths[part]] = self._patch(self._projection(layer, index))
            patches[paths["heads"]] = self._patch(self._heads(layer))
            patches[paths["mlp_norm"]] = self._patch(self._mlp_input(layer))
            patches[paths["mlp"]] = self._patch(self._record)
        return patches

    @staticmethod
    def _patch(op: Callable[[torch.Tensor], torch.Tensor]) -> CustomPatch:
        return CustomPatch(custom_op=op, requires_clone=False)

    def _embed(self, value: torch.Tensor) -> torch.Tensor:
        if self.embeddings is not None:
            value = self.embeddings.to(value.dtype).expand_as(value) + value * 0  # keeps the graph's autograd path
        self.upstream = [value]
        return value

    def _record(self, value: torch.Tensor) -> torch.Tensor:
        self.upstream.append(value)
        return value

    def _keep_input(self, layer: int) -> Callable[[torch.Tensor], torch.Tensor]:
        def op(value: torch.Tensor) -> torch.Tensor:
            self._inputs[layer] = value
            self._attn[layer] = self.deltas(layer, "attn", self.upstream)
            return value
        return op

    def _projection(self, layer: int, index: int) -> Callable[[torch.Tensor], torch.Tensor]:
        g = self.graph
        first = (0, g.heads, g.heads + g.kv_heads)[index]
        count = g.heads if index == 0 else g.kv_heads
        layout = g.layout
        block = layout.block(layer)

        def op(value: torch.Tensor) -> torch.Tensor:
            delta = self._attn[layer]
            if delta is None:
                return value
            norm = self.pg.original_module(f"{block}.{layout.attn_norm}")
            projection = self.pg.original_module(f"{block}.{layout.projections[index]}")  # type: ignore[index]
            normed = norm(self._inputs[layer].unsqueeze(2) + delta[:, :, first:first + count])  # [rows, seq, n, d]
            weight = projection.weight.reshape(count, g.head_dim, g.d_model)
            out = torch.einsum("rsnd,nkd->rsnk", normed, weight.to(normed.dtype))
            if projection.bias is not None:
                out = out + projection.bias.reshape(count, g.head_dim)
            return out.reshape(value.shape).to(value.dtype)
        return op

    def _heads(self, layer: int) -> Callable[[torch.Tensor], torch.Tensor]:
        g = self.graph

        def op(value: torch.Tensor) -> torch.Tensor:
            weight = self.pg.original_module(g.layout.path("out_projection", layer)).weight
            z = value.reshape(*value.shape[:2], g.heads, g.head_dim)
            contributions = torch.einsum("rshk,dhk->rshd", z, weight.reshape(g.d_model, g.heads, g.head_dim))
            self.upstream.extend(contributions.unbind(2))
            return value
        return op

    def _mlp_input(self, layer: int) -> Callable[[torch.Tensor], torch.Tensor]:
        def op(value: torch.Tensor) -> torch.Tensor:
            delta = self.deltas(layer, "mlp", self.upstream)
            return value if delta is None else value + delta[:, :, 0].to(value.dtype)
        return op

    def _logits(self, value: torch.Tensor) -> torch.Tensor:
        delta = self.deltas(None, "logits", self.upstream)
        return value if delta is None else value + delta[:, :, 0].to(value.dtype)
