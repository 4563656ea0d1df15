"""Where a model keeps the states causal tracing corrupts and restores: :class:`ModelPaths`, the one model-layout
table of :mod:`gradpatch.layouts` (:data:`LLAMA_PATHS`, :data:`GPT2_PATHS`), asked for the trace's states."""

from __future__ import annotations

from gradpatch import NodePathError, PatchableGraph
from gradpatch.errors import LayoutError
from gradpatch.layouts import GPT2_LAYOUT, LLAMA_LAYOUT, ModelLayout, check_layout, detect_layout, has_node
from gradpatch.layouts import count_layers as count_blocks

from ..errors import TraceError, TraceLayoutError

__all__ = ["GPT2_PATHS", "LLAMA_PATHS", "ModelPaths", "checked_paths", "count_layers", "detect_model_paths",
           "has_node", "layer_window", "tensor_width"]

#: The NodePaths of a model family (:class:`gradpatch.layouts.ModelLayout`): ``embed`` (noise is added there; its
#: module has the ``weight`` of the default noise scale), ``layer``, and relative to it ``hidden``, ``mlp`` and
#: ``attn``, the states of :data:`~editors.causal_trace.config.KINDS`; ``logits_input`` (``None``: skipped), where
#: the last position is kept alone.
ModelPaths = ModelLayout

#: Llama-style models (Llama, Mistral, Qwen2, SmolLM2): the defaults of :class:`ModelPaths`.
LLAMA_PATHS = LLAMA_LAYOUT

#: GPT-2 (noise goes on the token embeddings ``wte`` only, not on the position embeddings, as in the paper).
GPT2_PATHS = GPT2_LAYOUT

_FIX = "pass paths=ModelPaths(embed=..., layer=..., hidden=..., mlp=..., attn=...) naming its NodePaths (print " \
       "pg.graph to find them)"


def detect_model_paths(pg: PatchableGraph) -> ModelPaths:
    """The known layout (:data:`LLAMA_PATHS`, :data:`GPT2_PATHS`) whose NodePaths exist in ``pg``.

    Raises:
        TraceLayoutError: no known layout fits; the message names the NodePaths looked for and how to pass a
            :class:`ModelPaths`.
    """
    try:
        return detect_layout(pg)
    except LayoutError as error:
        raise TraceLayoutError(f"{error}; for causal tracing {_FIX}") from None


def checked_paths(pg: PatchableGraph, paths: ModelPaths) -> ModelPaths:
    """``paths`` once the states causal tracing corrupts and restores hold on ``pg``: the embeddings, and at every
    block the residual stream, the attention and the MLP as they add to it (``hidden == block_input + attn + mlp``;
    :func:`gradpatch.layouts.check_layout`).

    Raises:
        TraceLayoutError: a NodePath is missing, has another shape or breaks the block identity (the message names
            it and how to pass a :class:`ModelPaths`).
    """
    try:
        return check_layout(pg, paths, "causal tracing", parts=("embed", "hidden", "attn", "mlp"))
    except LayoutError as error:
        raise TraceLayoutError(f"{error}; for causal tracing {_FIX}") from None


def count_layers(pg: PatchableGraph, paths: ModelPaths) -> int:
    """Number of blocks: the first ``i`` for which ``paths.layer.format(i)`` does not exist.

    Raises:
        TraceLayoutError: not even layer 0 exists (the message says to pass ``paths=ModelPaths(layer=...)``).
    """
    try:
        return count_blocks(pg, paths)
    except LayoutError as error:
        raise TraceLayoutError(f"{error}; for causal tracing {_FIX}") from None


def tensor_width(pg: PatchableGraph, path: str, what: str) -> int:
    """The last dimension (``d_model``) of the tensor at NodePath ``path``.

    Raises:
        TraceError: ``path`` does not exist or is not a tensor (the message names the fix; ``what`` says which
            state it is, e.g. ``"embedding"``).
    """
    try:
        node = pg.node(path)
    except NodePathError as error:
        raise TraceLayoutError(f"The {what} NodePath {path!r} does not exist in this graph: {_FIX}") from error
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
