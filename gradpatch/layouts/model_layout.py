"""What a model family's layout says: :class:`ModelLayout`, the NodePaths of its embeddings, blocks, attention, MLP,
norms and unembedding, and the form of its blocks (sequential or parallel, norms before or after)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Literal

from ..errors import LayoutError

__all__ = ["BlockForm", "ModelLayout"]

#: How a block adds to the residual stream. Both forms compute ``output = input + attn + mlp`` (``attn`` and ``mlp``
#: being what is added, after any post-norm or residual multiplier); ``"sequential"``: the MLP reads ``input + attn``
#: (Llama, GPT-2, Gemma, OLMo 2); ``"parallel"``: the MLP reads the block input, as the attention does (GPT-J,
#: GPT-NeoX, Falcon, Cohere).
BlockForm = Literal["sequential", "parallel"]

#: The fields that are not NodePaths relative to a block.
_NOT_BLOCK_PARTS = ("family", "embed", "layer", "block_form", "final_norm", "norm_input", "logits_input")


@dataclass(frozen=True)
class ModelLayout:
    """The NodePaths of a model family (defaults: Llama-style models). Block parts are relative to ``layer``; a part
    the family does not have (separate projections where it fuses them, a norm it lacks) is ``None``, and a tool
    that needs it says so (:meth:`require`). :func:`~gradpatch.layouts.check_layout` accepts a layout for a graph
    only when every field it names exists with the shape promised here and the block identities hold.

    Attributes:
        family: the family's name in :data:`~gradpatch.layouts.LAYOUTS` (``"custom"`` for a layout of your own).
        embed: the token embeddings ``[batch, seq, d_model]``; its module (without ``.output``) has a ``weight``
            ``[vocab, d_model]``.
        layer: pattern of a block's NodePath, ``{}`` standing for the block index (``"model.layers_{}"``).
        block_form: ``"sequential"`` or ``"parallel"`` (:data:`BlockForm`).
        block_input: the block's input, the residual stream before it ``[batch, seq, d_model]``.
        hidden: the residual stream after the block ``[batch, seq, d_model]`` (attribution's ``"resid"`` kind):
            ``hidden == block_input + attn + mlp``.
        attn: what the attention adds to the residual stream ``[batch, seq, d_model]`` (after a post-attention norm
            or a residual multiplier where the family has one; a tensor: dig into tuples with ``|sub_0``).
        heads: the input of the attention output projection ``[batch, seq, n_heads * head_dim]``.
        queries: the queries ``[batch, heads, seq, head_dim]`` as the attention product receives them (after
            rotary embeddings and QK-norms), or ``None``.
        keys: the keys ``[batch, kv_heads, seq, head_dim]``, likewise, or ``None``.
        values: the values ``[batch, kv_heads, seq, head_dim]``, likewise, or ``None``.
        pattern_output: the attention's output before the heads are merged ``[batch, heads, seq, head_dim]``, or
            ``None``.
        mlp: what the MLP adds to the residual stream ``[batch, seq, d_model]`` (after a post-feedforward norm or a
            residual multiplier where the family has one).
        mlp_input: the MLP's input ``[batch, seq, d_model]`` (after its pre-norm: what a transcoder reads).
        mlp_out: the MLP's output projection, the layer ROME and MEMIT edit (a linear module, or a mixture of
            experts' fused ``[n_experts, ...]`` down-projection weight, one of whose experts they edit).
        attn_norm: the module of the norm before the attention, or ``None``.
        projections: the modules of the separate query, key and value projections, or ``None`` where the family
            fuses them (GPT-2's ``c_attn``, Phi-3's ``qkv_proj``).
        out_projection: the module of the attention output projection.
        mlp_norm: the module of the norm before the MLP (shared with the attention's in GPT-J), or ``None``.
        attn_post_norm: the module of the norm applied to the attention's output before the residual (Gemma 2/3,
            OLMo 2), or ``None``.
        mlp_post_norm: the module of the norm applied to the MLP's output before the residual, or ``None``.
        router_logits: a mixture-of-experts block's router logits ``[batch * seq, n_experts]``, or ``None``.
        expert_choice: the experts each token is sent to ``[batch * seq, top_k]`` (integer indices), or ``None``.
        experts: the module of the fused experts (3-D weights ``[n_experts, ...]``), or ``None``.
        final_norm: the module of the norm after the last block, or ``None``.
        norm_input: the name of a norm module's input node (``"hidden_states"`` for Llama's ``RMSNorm``).
        logits_input: the unembedding's input ``[batch, seq, d_model]``, or ``None``; where it exists, readers of the
            last position's logits keep that position alone there (the vocabulary projection then runs once per
            row).
    """

    family: str = "custom"
    embed: str = "model.embed_tokens.output"
    layer: str = "model.layers_{}"
    block_form: BlockForm = "sequential"
    block_input: str = "hidden_states"
    hidden: str = "output"
    attn: str = "self_attn.output|sub_0"
    heads: str = "self_attn.o_proj.input"
    queries: str | None = "self_attn.q_embed"
    keys: str | None = "self_attn.k_embed"
    values: str | None = "self_attn.value_states"
    pattern_output: str | None = "self_attn.attn_output"
    mlp: str = "mlp.output"
    mlp_input: str = "mlp.x"
    mlp_out: str = "mlp.down_proj"
    attn_norm: str | None = "input_layernorm"
    projections: tuple[str, str, str] | None = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
    out_projection: str = "self_attn.o_proj"
    mlp_norm: str | None = "post_attention_layernorm"
    attn_post_norm: str | None = None
    mlp_post_norm: str | None = None
    router_logits: str | None = None
    expert_choice: str | None = None
    experts: str | None = None
    final_norm: str | None = "model.norm"
    norm_input: str = "hidden_states"
    logits_input: str | None = "lm_head.input"

    def __post_init__(self) -> None:
        if self.block_form not in ("sequential", "parallel"):
            raise LayoutError(f"block_form must be 'sequential' or 'parallel', got {self.block_form!r}")

    def block(self, layer: int) -> str:
        """The NodePath of block ``layer`` (``block(3) == "model.layers_3"``)."""
        return self.layer.format(layer)

    def path(self, part: str, layer: int) -> str:
        """The NodePath of block part ``part`` (a field name, or ``"resid"`` for ``hidden``) at block ``layer``,
        e.g. ``path("mlp", 3) == "model.layers_3.mlp.output"``.

        Raises:
            LayoutError: ``part`` is not a field naming a block part, or this family has no such part (the field is
                ``None``: the message says which family and what to pass).
        """
        name = "hidden" if part == "resid" else part
        if name in _NOT_BLOCK_PARTS or name not in {f.name for f in fields(self)}:
            raise LayoutError(f"{part!r} is not a part of a block of this layout: give a field of ModelLayout such "
                              f"as hidden, attn, heads, mlp")
        relative = self.require(name)
        if not isinstance(relative, str):
            raise LayoutError(f"{part!r} names several modules ({relative}); ask for one of them by NodePath")
        return f"{self.block(layer)}.{relative}"

    def template(self, part: str) -> str:
        """The NodePath of block part ``part`` with ``{layer}`` for the block index (what a file of per-layer
        dictionaries names its nodes by), e.g. ``template("mlp_input") == "model.layers_{layer}.mlp.x"``.

        Raises:
            LayoutError: as :meth:`path`.
        """
        return self.path(part, 0).replace(self.block(0), self.layer.replace("{}", "{layer}"), 1)

    def require(self, part: str, tool: str = "this tool") -> str | tuple[str, str, str]:
        """The value of field ``part``, which must not be ``None``.

        Raises:
            LayoutError: the family has no such part (e.g. ``projections`` where the query, key and value
                projections are fused); the message names the family, the part and ``tool``, which needs it.
        """
        value = getattr(self, part)
        if value is None:
            why = _ABSENT.get(part, "this family lacks it")
            raise LayoutError(f"the {self.family!r} layout has no {part!r} ({why}): {tool} needs it; pass NodePaths "
                              f"instead, or a ModelLayout naming this model's {part}")
        return value

    @property
    def resid(self) -> str:
        """The residual stream after a block, relative to ``layer`` (the name attribution's node kind uses)."""
        return self.hidden

    @property
    def embed_module(self) -> str:
        """The NodePath of the embedding module (``embed`` without its final ``.output``)."""
        return self.embed[: -len(".output")] if self.embed.endswith(".output") else self.embed

    @property
    def adds_outputs_unchanged(self) -> bool:
        """Whether the blocks add the attention module's and the MLP module's outputs to the residual stream as they
        are (no post-norm, no multiplier): a change of an MLP's output is the same change of ``hidden``."""
        return not self.post_norms and all(part.split("|")[0].endswith(".output") for part in (self.attn, self.mlp))

    @property
    def post_norms(self) -> bool:
        """Whether a norm sits between the attention or the MLP and the residual stream (Gemma 2/3, OLMo 2)."""
        return self.attn_post_norm is not None or self.mlp_post_norm is not None


#: Why a field may be absent, for :meth:`ModelLayout.require`'s message.
_ABSENT = {
    "projections": "its query, key and value projections are fused",
    "queries": "its queries are not separate [batch, heads, seq, head_dim] values",
    "keys": "its keys are not separate [batch, kv_heads, seq, head_dim] values",
    "values": "its values are not separate [batch, kv_heads, seq, head_dim] values",
    "pattern_output": "its attention output is not a [batch, heads, seq, head_dim] value",
    "attn_norm": "it has no norm before the attention",
    "mlp_norm": "it has no norm before the MLP",
    "router_logits": "it is not a mixture of experts",
    "expert_choice": "it is not a mixture of experts",
    "experts": "it is not a mixture of experts",
    "final_norm": "it has no final norm",
    "logits_input": "its unembedding input is not a node",
}
