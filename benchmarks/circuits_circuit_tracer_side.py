"""circuit-tracer's side of benchmarks/circuits_circuit_tracer.py, run in a virtualenv where circuit-tracer 0.5.0
imports (it imports no gradpatch).

``graph FOLDER``: reads ``FOLDER/model`` (a Hugging Face model folder: ``config.json``, ``model.safetensors`` and the
tokenizer's files), the transcoder set ``FOLDER/transcoders/config.yaml`` (circuit-tracer's local layout, written by
:func:`gradpatch.dictionaries.export_circuit_tracer`) and ``FOLDER/prompt.json`` (``{"ids": [...], "batch_size":
b}``); rewrites the set in 0.5.0's file layout (:func:`relayout`); builds circuit-tracer's ``ReplacementModel`` with its nnsight backend on the CPU in float32 (its
TransformerLens backend accepts only model names on TransformerLens's official list) and runs its ``attribute``
with every feature node (``max_feature_nodes=None``) and its default logit selection. Writes
``FOLDER/circuit_tracer_graph.safetensors`` (``adjacency`` ``[n, n]``, ``active_features`` ``[n_features, 3]``,
``activation_values``, ``logit_tokens``, ``logit_probabilities``) and ``FOLDER/circuit_tracer_run.json`` (seconds of
the model's load and of ``attribute``, resident memory after the load and at the peak).

Run: ``/work/peers/circuit-tracer-05/bin/python benchmarks/circuits_circuit_tracer_side.py graph FOLDER``.
"""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path
from typing import Any

import torch
import yaml
from circuit_tracer import ReplacementModel, attribute
from circuit_tracer.transcoder.single_layer_transcoder import load_transcoder_set
from safetensors.torch import load_file, save_file


def _rss_gib() -> float:
    """The resident memory now, GiB (``/proc/self/statm``)."""
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * resource.getpagesize() / 2**30


def relayout(config: dict, folder: Path) -> dict[int, str]:
    """The set in circuit-tracer 0.5.0's file layout, written to ``folder``: layer -> path.

    The set that gradpatch exports has circuit-tracer d797c82's layout, ``W_dec`` ``[d_model, d_sae]`` (its loader
    transposes it); 0.5.0's ``load_relu_transcoder`` loads ``W_dec`` as it is into a ``[d_sae, d_model]`` parameter
    (the layout its ``to_safetensors`` writes), so ``W_dec`` is transposed here. ``W_enc`` ``[d_sae, d_model]``,
    ``b_enc``, ``b_dec`` and ``W_skip`` mean the same in both."""
    folder.mkdir(exist_ok=True)
    paths = {}
    for entry in config["transcoders"]:
        tensors = load_file(entry["filepath"])
        tensors["W_dec"] = tensors["W_dec"].T.contiguous()
        paths[entry["layer"]] = str(folder / f"layer_{entry['layer']}.safetensors")
        save_file(tensors, paths[entry["layer"]])
    return paths


def transformerlens_model(folder: Path, transcoders: Any) -> Any:
    """circuit-tracer's TransformerLens-backend model of a local Llama or GPT-2 folder.

    ``HookedTransformer.from_pretrained`` (which circuit-tracer's ``from_pretrained_and_transcoders`` calls) accepts
    only names on TransformerLens's official list (``get_official_model_name`` raises ``ValueError: ... not found``
    for a folder, and SmolLM2 is not on the list of transformer-lens 2.16.1), so the config is written here as
    TransformerLens's ``convert_hf_model_config`` writes a Llama's or a GPT-2's, the weights converted
    with its ``convert_llama_weights`` or ``convert_gpt2_weights`` and processed as circuit-tracer's ``from_pretrained_and_transcoders`` does
    (``fold_ln``, ``center_writing_weights``, ``center_unembed`` off), then circuit-tracer's replacement hooks are
    configured (``_configure_replacement_model``, what its ``from_config`` calls)."""
    from transformer_lens import HookedTransformerConfig
    from transformer_lens.pretrained.weight_conversions import convert_gpt2_weights, convert_llama_weights
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from circuit_tracer.replacement_model.replacement_model_transformerlens import TransformerLensReplacementModel

    hf_model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    hf = hf_model.config
    common = {"model_name": str(folder), "device": "cpu", "dtype": torch.float32, "default_prepend_bos": False}
    if hf.model_type == "gpt2":
        config = HookedTransformerConfig(
            d_model=hf.n_embd, d_head=hf.n_embd // hf.n_head, n_heads=hf.n_head, d_mlp=hf.n_inner or 4 * hf.n_embd,
            n_layers=hf.n_layer, n_ctx=hf.n_positions, eps=hf.layer_norm_epsilon, d_vocab=hf.vocab_size,
            act_fn=hf.activation_function, use_attn_scale=True, use_local_attn=False,
            scale_attn_by_inverse_layer_idx=hf.scale_attn_by_inverse_layer_idx, normalization_type="LN",
            original_architecture="GPT2LMHeadModel", **common)
        convert = convert_gpt2_weights
    else:
        kv_heads = hf.num_key_value_heads if hf.num_key_value_heads != hf.num_attention_heads else None
        config = HookedTransformerConfig(
            d_model=hf.hidden_size, d_head=hf.hidden_size // hf.num_attention_heads, n_heads=hf.num_attention_heads,
            d_mlp=hf.intermediate_size, n_layers=hf.num_hidden_layers, n_ctx=hf.max_position_embeddings,
            eps=hf.rms_norm_eps, d_vocab=hf.vocab_size, act_fn=hf.hidden_act, n_key_value_heads=kv_heads,
            normalization_type="RMS", positional_embedding_type="rotary", rotary_adjacent_pairs=False,
            rotary_dim=hf.hidden_size // hf.num_attention_heads, rotary_base=hf.rope_theta, final_rms=True,
            gated_mlp=True, original_architecture="LlamaForCausalLM", **common)
        convert = convert_llama_weights
    model = TransformerLensReplacementModel(config, AutoTokenizer.from_pretrained(str(folder)))
    model.load_and_process_state_dict(convert(hf_model, config), fold_ln=False,
                                      center_writing_weights=False, center_unembed=False)
    model._configure_replacement_model(transcoders)
    return model


def graph(folder: Path, backend: str = "nnsight") -> None:
    prompt = json.loads((folder / "prompt.json").read_text())
    config = yaml.safe_load((folder / "transcoders" / "config.yaml").read_text())
    paths = relayout(config, folder / "transcoders_0.5")
    start = time.perf_counter()
    transcoders = load_transcoder_set(paths, "gradpatch-export", config["feature_input_hook"],
                                      config["feature_output_hook"], device=torch.device("cpu"),
                                      dtype=torch.float32, lazy_encoder=False, lazy_decoder=False)
    if backend == "nnsight":
        model = ReplacementModel.from_pretrained_and_transcoders(str(folder / "model"), transcoders,
                                                                 backend="nnsight", device=torch.device("cpu"),
                                                                 dtype=torch.float32)
    else:
        model = transformerlens_model(folder / "model", transcoders)
    loaded = time.perf_counter() - start
    rss_loaded = _rss_gib()
    start = time.perf_counter()
    result = attribute(torch.tensor(prompt["ids"]), model, batch_size=prompt["batch_size"], max_feature_nodes=None)
    seconds = time.perf_counter() - start
    save_file({"adjacency": result.adjacency_matrix.float().contiguous(),
               "active_features": result.active_features.long().contiguous(),
               "activation_values": result.activation_values.float().contiguous(),
               "logit_tokens": torch.tensor([t.vocab_idx for t in result.logit_targets]),
               "logit_probabilities": result.logit_probabilities.float().contiguous()},
              str(folder / f"circuit_tracer_graph_{backend}.safetensors"))
    (folder / f"circuit_tracer_run_{backend}.json").write_text(json.dumps({
        "load_seconds": round(loaded, 2), "attribute_seconds": round(seconds, 2),
        "rss_after_load_gib": round(rss_loaded, 3),
        "max_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3),
        "torch_threads": torch.get_num_threads()}))


if __name__ == "__main__":
    command, path = sys.argv[1], Path(sys.argv[2])
    {"graph": graph}[command](path, *sys.argv[3:])
