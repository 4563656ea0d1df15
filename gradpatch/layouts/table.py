"""The one table of model layouts: one :class:`~gradpatch.layouts.model_layout.ModelLayout` per family of transformers'
causal language models, as data. :func:`~gradpatch.layouts.detect_layout` tries them in the order of :data:`LAYOUTS`
and accepts the first whose NodePaths, shapes and block identities hold on the graph (checked by
:func:`~gradpatch.layouts.check_layout`); docs/architectures.md lists which tools run on which family."""

from __future__ import annotations

from dataclasses import replace

from .model_layout import ModelLayout

__all__ = ["COHERE_LAYOUT", "FALCON_LAYOUT", "GEMMA_LAYOUT", "GPT2_LAYOUT", "GPTJ_LAYOUT",
           "GPT_NEOX_LAYOUT", "GPT_NEOX_SEQUENTIAL_LAYOUT", "GPT_OSS_LAYOUT", "GRANITE_LAYOUT", "LAYOUTS",
           "LLAMA_LAYOUT", "MOE_LAYOUT", "OLMO2_LAYOUT", "PHI3_LAYOUT", "STABLELM_LAYOUT"]

#: Llama-style models (Llama, Mistral, Qwen2, Qwen3 with its QK-norms, SmolLM2): the defaults of ModelLayout.
LLAMA_LAYOUT = ModelLayout(family="llama")

#: Granite: Llama's modules, but each block scales what the attention and the MLP add by ``residual_multiplier``
#: (the block's ``mul`` and ``mul_1``).
GRANITE_LAYOUT = replace(LLAMA_LAYOUT, family="granite", attn="mul", mlp="mul_1")

#: Mixtures of experts with Llama's attention (Qwen3-MoE, Mixtral): the router's logits, the chosen experts and the
#: fused experts of each block's sparse MLP.
MOE_LAYOUT = replace(LLAMA_LAYOUT, family="moe", mlp_input="mlp.hidden_states", mlp_out="mlp.experts.down_proj",
                     router_logits="mlp.gate.router_logits", expert_choice="mlp.gate.router_indices",
                     experts="mlp.experts")

#: GPT-OSS: a mixture of experts whose MLP returns ``(output, router scores)``; eager attention with sinks.
GPT_OSS_LAYOUT = replace(MOE_LAYOUT, family="gpt_oss", mlp="mlp.output|sub_0",
                         router_logits="mlp.router.router_logits", expert_choice="mlp.router.router_indices")

#: Gemma 2 and Gemma 3: norms before and after the attention and the MLP (what is added to the residual is the
#: post-norm's output); its norms name their input ``x``. Gemma 3 adds QK-norms; its scaled dot-product attention
#: receives the keys and values repeated over the query heads, so ``keys`` and ``values`` are the key/value heads
#: before the repetition.
GEMMA_LAYOUT = replace(LLAMA_LAYOUT, family="gemma", attn="post_attention_layernorm.output",
                       mlp="post_feedforward_layernorm.output", mlp_norm="pre_feedforward_layernorm",
                       attn_post_norm="post_attention_layernorm", mlp_post_norm="post_feedforward_layernorm",
                       norm_input="x")

#: OLMo 2: norms after the attention and the MLP only (none before them), QK-norms before the rotary embedding.
OLMO2_LAYOUT = replace(LLAMA_LAYOUT, family="olmo2", attn="post_attention_layernorm.output",
                       mlp="post_feedforward_layernorm.output", attn_norm=None, mlp_norm=None,
                       attn_post_norm="post_attention_layernorm", mlp_post_norm="post_feedforward_layernorm",
                       queries="self_attn.query_states_2", keys="self_attn.key_states_2",
                       values="self_attn.value_states_1")

#: Phi-3: fused query/key/value projection ``qkv_proj`` (no separate projections) and fused ``gate_up_proj``.
PHI3_LAYOUT = replace(LLAMA_LAYOUT, family="phi3", projections=None, values="self_attn.value_states_1",
                      mlp_input="mlp.hidden_states")

#: StableLM: LayerNorms (input ``input``), partial rotary embeddings.
STABLELM_LAYOUT = replace(LLAMA_LAYOUT, family="stablelm", queries="self_attn.query_states_2",
                          keys="self_attn.key_states_2", values="self_attn.value_states_1", norm_input="input")

#: Cohere: parallel attention and MLP reading the one ``input_layernorm``; interleaved rotary embeddings.
COHERE_LAYOUT = replace(LLAMA_LAYOUT, family="cohere", block_form="parallel", mlp_norm="input_layernorm",
                        queries="self_attn.query_states_2", keys="self_attn.key_states_2",
                        values="self_attn.value_states_1")

#: GPT-2: noise and interpolations go on the token embeddings ``wte`` only, not on the position embeddings; its
#: ``Conv1D`` output projection names its input ``x``; it fuses the query, key and value projections (``c_attn``).
GPT2_LAYOUT = ModelLayout(
    family="gpt2", embed="transformer.wte.output", layer="transformer.h_{}", block_input="hidden_states",
    hidden="output", attn="attn.output|sub_0", heads="attn.c_proj.x", queries="attn.query_states_1",
    keys="attn.key_states_1", values="attn.value_states_1", pattern_output="attn.attn_output", mlp="mlp.output",
    mlp_input="mlp.hidden_states", mlp_out="mlp.c_proj", attn_norm="ln_1", projections=None,
    out_projection="attn.c_proj",
    mlp_norm="ln_2", final_norm="transformer.ln_f", norm_input="input", logits_input="lm_head.input",
)

#: GPT-J: parallel attention and MLP, both reading ``ln_1``; separate projections without biases.
GPTJ_LAYOUT = replace(
    GPT2_LAYOUT, family="gptj", block_form="parallel", heads="attn.out_proj.input", queries="attn.query_2",
    keys="attn.key_2", values="attn.value", projections=("attn.q_proj", "attn.k_proj", "attn.v_proj"),
    out_projection="attn.out_proj", mlp_out="mlp.fc_out", mlp_norm="ln_1",
)

#: GPT-NeoX (Pythia) with its default parallel residual: fused ``query_key_value``, partial rotary embeddings.
GPT_NEOX_LAYOUT = ModelLayout(
    family="gpt_neox", embed="gpt_neox.embed_in.output", layer="gpt_neox.layers_{}", block_form="parallel",
    attn="attention.output|sub_0", heads="attention.dense.input", queries="attention.q_embed_1",
    keys="attention.k_embed_1", values="attention.value_states", pattern_output="attention.attn_output",
    mlp_input="mlp.hidden_states", mlp_out="mlp.dense_4h_to_h", projections=None, out_projection="attention.dense",
    final_norm="gpt_neox.final_layer_norm", norm_input="input",
)

#: GPT-NeoX with ``use_parallel_residual=False``: the same NodePaths in a sequential block.
GPT_NEOX_SEQUENTIAL_LAYOUT = replace(GPT_NEOX_LAYOUT, family="gpt_neox_sequential", block_form="sequential")

#: Falcon (7B/40B-style parallel attention, one ``input_layernorm``): blocks return ``(output, attention weights)``.
FALCON_LAYOUT = ModelLayout(
    family="falcon", embed="transformer.word_embeddings.output", layer="transformer.h_{}", block_form="parallel",
    hidden="output|sub_0", attn="self_attention.output|sub_0", heads="self_attention.dense.input",
    queries="self_attention.q_embed", keys="self_attention.k_embed", values="self_attention.value_layer_1",
    pattern_output="self_attention.attn_output", mlp_out="mlp.dense_4h_to_h", projections=None,
    out_projection="self_attention.dense", mlp_norm="input_layernorm", final_norm="transformer.ln_f",
    norm_input="input",
)

#: The known families, in the order :func:`~gradpatch.layouts.detect_layout` tries them.
LAYOUTS: dict[str, ModelLayout] = {layout.family: layout for layout in (
    LLAMA_LAYOUT, GRANITE_LAYOUT, MOE_LAYOUT, GPT_OSS_LAYOUT, GEMMA_LAYOUT, OLMO2_LAYOUT, PHI3_LAYOUT,
    STABLELM_LAYOUT, COHERE_LAYOUT, GPT2_LAYOUT, GPTJ_LAYOUT, GPT_NEOX_LAYOUT, GPT_NEOX_SEQUENTIAL_LAYOUT,
    FALCON_LAYOUT,
)}
