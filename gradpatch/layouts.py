"""Where each model family keeps its parts: the one table of model layouts, asked by causal tracing, attribution and
the edge graph.

A :class:`ModelLayout` names, as NodePaths, a family's token embeddings, its transformer blocks (``layer``, ``{}``
standing for the block index) and, relative to a block, its input, its residual output, its attention (the heads'
concatenated outputs, queries, keys, values, the output added to the residual stream) and its MLP, then the final
norm and the unembedding's input. Two families are known (:data:`LLAMA_LAYOUT`: Llama, Mistral, Qwen2, SmolLM2;
:data:`GPT2_LAYOUT`); :func:`detect_layout` picks the one whose NodePaths exist in a graph, and a graph of another
family gets one :class:`~gradpatch.errors.LayoutError` naming the NodePaths looked for. Any other family is a
``ModelLayout(...)`` of its own NodePaths (print ``pg.graph`` to find them).
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import LayoutError, NodePathError
from .patchable_graph import PatchableGraph

__all__ = ["GPT2_LAYOUT", "LAYOUTS", "LLAMA_LAYOUT", "ModelLayout", "count_layers", "detect_layout", "has_node",
           "logits_input"]


@dataclass(frozen=True)
class ModelLayout:
    """The NodePaths of a model family (defaults: Llama-style models). Block parts are relative to ``layer``.

    Attributes:
        embed: the token embeddings ``[batch, seq, d_model]``; its module (without ``.output``) has a ``weight``
            ``[vocab, d_model]``.
        layer: pattern of a block's NodePath, ``{}`` standing for the block index (``"model.layers_{}"``).
        block_input: the block's input, the residual stream before it ``[batch, seq, d_model]``.
        hidden: the residual stream after the block ``[batch, seq, d_model]`` (attribution's ``"resid"`` kind).
        attn: the attention's output as it is added to the residual stream ``[batch, seq, d_model]`` (a tensor: dig
            into tuples with ``|sub_0``).
        heads: the input of the attention output projection ``[batch, seq, n_heads * head_dim]``.
        queries: the queries ``[batch, heads, seq, head_dim]`` as scaled dot-product attention receives them (after
            rotary embeddings).
        keys: the keys ``[batch, kv_heads, seq, head_dim]``, likewise.
        values: the values ``[batch, kv_heads, seq, head_dim]``, likewise.
        pattern_output: the attention's output before the heads are merged ``[batch, heads, seq, head_dim]``.
        mlp: the MLP's output ``[batch, seq, d_model]``.
        attn_norm: the module of the norm before the attention, or ``None``.
        projections: the modules of the separate query, key and value projections, or ``None`` where the family
            fuses them (GPT-2's ``c_attn``).
        out_projection: the module of the attention output projection.
        mlp_norm: the module of the norm before the MLP, or ``None``.
        final_norm: the module of the norm after the last block, or ``None``.
        norm_input: the name of a norm module's input node (``"hidden_states"`` for Llama's ``RMSNorm``).
        logits_input: the unembedding's input ``[batch, seq, d_model]``, or ``None``; where it exists, readers of the
            last position's logits keep that position alone there (the vocabulary projection then runs once per
            row).
    """

    embed: str = "model.embed_tokens.output"
    layer: str = "model.layers_{}"
    block_input: str = "hidden_states"
    hidden: str = "output"
    attn: str = "self_attn.output|sub_0"
    heads: str = "self_attn.o_proj.input"
    queries: str = "self_attn.q_embed"
    keys: str = "self_attn.k_embed"
    values: str = "self_attn.value_states"
    pattern_output: str = "self_attn.attn_output"
    mlp: str = "mlp.output"
    attn_norm: str | None = "input_layernorm"
    projections: tuple[str, str, str] | None = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
    out_projection: str = "self_attn.o_proj"
    mlp_norm: str | None = "post_attention_layernorm"
    final_norm: str | None = "model.norm"
    norm_input: str = "hidden_states"
    logits_input: str | None = "lm_head.input"

    def block(self, layer: int) -> str:
        """The NodePath of block ``layer`` (``block(3) == "model.layers_3"``)."""
        return self.layer.format(layer)

    def path(self, part: str, layer: int) -> str:
        """The NodePath of block part ``part`` (a field name, or ``"resid"`` for ``hidden``) at block ``layer``,
        e.g. ``path("mlp", 3) == "model.layers_3.mlp.output"``.

        Raises:
            LayoutError: ``part`` is not a string field naming a block part.
        """
        relative = getattr(self, "hidden" if part == "resid" else part, None)
        if part in ("embed", "layer", "final_norm", "norm_input", "logits_input") or not isinstance(relative, str):
            raise LayoutError(f"{part!r} is not a part of a block of this layout: give a field of ModelLayout such "
                              f"as hidden, attn, heads, mlp")
        return f"{self.block(layer)}.{relative}"

    @property
    def resid(self) -> str:
        """The residual stream after a block, relative to ``layer`` (the name attribution's node kind uses)."""
        return self.hidden

    @property
    def embed_module(self) -> str:
        """The NodePath of the embedding module (``embed`` without its final ``.output``)."""
        return self.embed[: -len(".output")] if self.embed.endswith(".output") else self.embed


#: Llama-style models (Llama, Mistral, Qwen2, SmolLM2): the defaults of :class:`ModelLayout`.
LLAMA_LAYOUT = ModelLayout()

#: GPT-2: noise and interpolations go on the token embeddings ``wte`` only, not on the position embeddings; its
#: ``Conv1D`` output projection names its input ``x``; it fuses the query, key and value projections (``c_attn``).
GPT2_LAYOUT = ModelLayout(
    embed="transformer.wte.output", layer="transformer.h_{}", block_input="hidden_states", hidden="output",
    attn="attn.output|sub_0", heads="attn.c_proj.x", queries="attn.query_states_1", keys="attn.key_states_1",
    values="attn.value_states_1", pattern_output="attn.attn_output", mlp="mlp.output", attn_norm="ln_1",
    projections=None, out_projection="attn.c_proj", mlp_norm="ln_2", final_norm="transformer.ln_f",
    norm_input="input", logits_input="lm_head.input",
)

#: The known families, in the order :func:`detect_layout` tries them.
LAYOUTS: dict[str, ModelLayout] = {"llama": LLAMA_LAYOUT, "gpt2": GPT2_LAYOUT}


def has_node(pg: PatchableGraph, path: str) -> bool:
    """Whether NodePath ``path`` names a node of ``pg`` (a graph, a container or a tensor)."""
    try:
        pg.node(path)
    except NodePathError:
        return False
    return True


def detect_layout(pg: PatchableGraph) -> ModelLayout:
    """The known layout (:data:`LAYOUTS`) whose token embeddings and first block exist in ``pg``.

    Raises:
        LayoutError: no known layout fits; the message names the NodePaths looked for.
    """
    for layout in LAYOUTS.values():
        if has_node(pg, layout.embed) and has_node(pg, layout.block(0)):
            return layout
    looked_for = "; ".join(f"{name}: {layout.embed} and {layout.block(0)}" for name, layout in LAYOUTS.items())
    raise LayoutError(f"no known model layout fits this graph (looked for {looked_for}): name this model's "
                      f"NodePaths in a ModelLayout(embed=..., layer=..., ...) (print pg.graph to find them)")


def count_layers(pg: PatchableGraph, layout: ModelLayout) -> int:
    """The number of blocks: the first ``i`` for which ``layout.block(i)`` does not exist.

    Raises:
        LayoutError: not even block 0 exists (the message names the NodePath looked for).
    """
    n = 0
    while has_node(pg, layout.block(n)):
        n += 1
    if n == 0:
        raise LayoutError(f"no block {layout.block(0)!r} in this graph: give the pattern of the blocks' NodePaths "
                          f"('{{}}' for the index), e.g. ModelLayout(layer='transformer.h_{{}}') for GPT-2")
    return n


def logits_input(pg: PatchableGraph, layout: ModelLayout | None = None) -> str | None:
    """The unembedding's input NodePath ``[batch, seq, d_model]`` of ``layout`` (default: of any known layout) where
    it exists in ``pg``, else ``None``. Readers of the last position's logits keep that position alone there."""
    candidates = LAYOUTS.values() if layout is None else (layout,)
    return next((c.logits_input for c in candidates if c.logits_input and has_node(pg, c.logits_input)), None)
