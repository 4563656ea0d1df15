"""Where a model family keeps the states causal tracing corrupts and restores: :class:`ModelPaths` and presets."""

from __future__ import annotations

from dataclasses import dataclass

from gradpatch import NodePathError, PatchableGraph

from ..errors import TraceError
from .config import KINDS

__all__ = ["GPT2_PATHS", "LLAMA_PATHS", "ModelPaths", "count_layers", "detect_model_paths", "has_node",
           "layer_window", "tensor_width"]


@dataclass(frozen=True)
class ModelPaths:
    """Where a model family keeps the states causal tracing corrupts and restores.

    Attributes:
        embed: NodePath of the token embeddings ``[batch, seq, d_model]`` (noise is added here). Its module
            (the path without ``.output``) should have a ``weight`` ``[vocab, d_model]`` for the default noise
            scale.
        layer: pattern of a transformer block's NodePath, ``{}`` standing for the layer index.
        hidden: NodePath of the hidden state after a block, relative to ``layer``.
        mlp: NodePath of a block's MLP output, relative to ``layer``.
        attn: NodePath of a block's attention output (a tensor, so dig into tuples), relative to ``layer``.
        logits_input: NodePath of the unembedding's input ``[batch, seq, d_model]``, or ``None``. Only the last
            position's logits are read, so a patch there keeps the last position alone and the vocabulary
            projection runs once per row instead of once per token (for SmolLM2, 49152 x 576: a fifth of the
            FLOPs of a 10-token prompt). Skipped when the node does not exist.
    """

    embed: str = "model.embed_tokens.output"
    layer: str = "model.layers_{}"
    hidden: str = "output"
    mlp: str = "mlp.output"
    attn: str = "self_attn.output|sub_0"
    logits_input: str | None = "lm_head.input"

    def node(self, kind: str, layer: int) -> str:
        """The NodePath of state ``kind`` at ``layer``, e.g. ``node("mlp", 3) == "model.layers_3.mlp.output"``.

        Raises:
            TraceError: unknown ``kind``.
        """
        if kind not in KINDS:
            raise TraceError(f"Unknown kind {kind!r}: choose among {', '.join(KINDS)}")
        return f"{self.layer.format(layer)}.{getattr(self, kind)}"

    @property
    def embed_module(self) -> str:
        """NodePath of the embedding module (``embed`` without its final ``.output``)."""
        return self.embed[: -len(".output")] if self.embed.endswith(".output") else self.embed


#: Llama-style models (Llama, Mistral, Qwen2, SmolLM2): the defaults of :class:`ModelPaths`.
LLAMA_PATHS = ModelPaths()

#: GPT-2 (noise goes on the token embeddings ``wte`` only, not on the position embeddings, as in the paper).
GPT2_PATHS = ModelPaths(
    embed="transformer.wte.output", layer="transformer.h_{}", hidden="output", mlp="mlp.output",
    attn="attn.output|sub_0", logits_input="lm_head.input",
)

_PRESETS: tuple[ModelPaths, ...] = (LLAMA_PATHS, GPT2_PATHS)


def has_node(pg: PatchableGraph, path: str) -> bool:
    """Whether NodePath ``path`` exists in ``pg``."""
    try:
        pg.node(path)
    except NodePathError:
        return False
    return True


def detect_model_paths(pg: PatchableGraph) -> ModelPaths:
    """Pick the preset (:data:`LLAMA_PATHS`, :data:`GPT2_PATHS`) whose NodePaths exist in ``pg``.

    Raises:
        TraceError: no preset fits; the message says how to pass a :class:`ModelPaths`.
    """
    for paths in _PRESETS:
        if has_node(pg, paths.embed) and has_node(pg, paths.node("hidden", 0)):
            return paths
    raise TraceError(
        "No known model family fits this graph (looked for model.layers_0 / transformer.h_0): pass "
        "paths=ModelPaths(embed=..., layer=..., hidden=..., mlp=..., attn=...) naming its NodePaths "
        "(print pg.graph to find them)"
    )


def count_layers(pg: PatchableGraph, paths: ModelPaths) -> int:
    """Number of blocks: the first ``i`` for which ``paths.layer.format(i)`` does not exist.

    Raises:
        TraceError: not even layer 0 exists.
    """
    n = 0
    while has_node(pg, paths.layer.format(n)):
        n += 1
    if n == 0:
        raise TraceError(
            f"No layer {paths.layer.format(0)!r} in the graph: pass paths=ModelPaths(layer=...) with the pattern of "
            f"the blocks' NodePaths ('{{}}' for the index), e.g. 'transformer.h_{{}}' for GPT-2"
        )
    return n


def tensor_width(pg: PatchableGraph, path: str, what: str) -> int:
    """The last dimension (``d_model``) of the tensor at NodePath ``path``.

    Raises:
        TraceError: ``path`` does not exist or is not a tensor (the message names the fix; ``what`` says which
            state it is, e.g. ``"embedding"``).
    """
    try:
        node = pg.node(path)
    except NodePathError as error:
        raise TraceError(
            f"The {what} NodePath {path!r} does not exist in this graph: pass paths=ModelPaths(...) with this "
            f"model's NodePaths (print pg.graph to find them)"
        ) from error
    shape = node.tensor_shape
    if shape is None or len(shape) == 0:
        raise TraceError(
            f"The {what} NodePath {path!r} is not a tensor (it is a graph or a container): name its tensor "
            f"output, e.g. '{path}.output' or '{path}|sub_0'"
        )
    return int(shape[-1])


def layer_window(center: int, window: int, num_layers: int) -> range:
    """The layers restored together for a heatmap cell at layer ``center`` (paper section 2.1).

    As in the paper's code, a window of ``w`` layers covers ``[center - w // 2, center + ceil(w / 2))``
    clipped to ``[0, num_layers)``: window 10 at layer 12 restores layers 7..16, window 1 layer 12 only.

    Raises:
        TraceError: ``window < 1``.
    """
    if window < 1:
        raise TraceError(f"window must be at least 1 layer, got {window}")
    return range(max(0, center - window // 2), min(num_layers, center - (-window // 2)))
