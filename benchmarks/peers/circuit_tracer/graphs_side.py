"""circuit-tracer's side of benchmarks/circuits/circuit_tracer_graphs.py, run in a virtualenv where circuit-tracer
imports (it imports no gradpatch).

``graph FOLDER BACKEND``: reads ``FOLDER/model`` (a Hugging Face model folder: ``config.json``, ``model.safetensors``
and the tokenizer's files), the transcoder set ``FOLDER/transcoders/config.yaml`` (circuit-tracer's local layout as
:func:`gradpatch.dictionaries.export_circuit_tracer` writes it) and ``FOLDER/prompt.json`` (``{"ids": [...],
"batch_size": b}``); builds circuit-tracer's replacement model on the CPU in float32 (:func:`replacement_model`:
0.5.0's ``nnsight`` or ``transformerlens`` backend, or the ``d797c82`` source) and runs its ``attribute`` with every
feature node (``max_feature_nodes=None``) and its default logit selection. Writes
``FOLDER/circuit_tracer_graph_BACKEND.safetensors`` (``adjacency`` ``[n, n]``, ``active_features``
``[n_features, 3]``, ``activation_values``, ``logit_tokens``, ``logit_probabilities``) and
``FOLDER/circuit_tracer_run_BACKEND.json`` (seconds of the load and of ``attribute``, CPU seconds of ``attribute``,
the 1-minute load average before and after it, resident memory after the load and at the peak).

Run (from the repository's root): ``.peers/circuit_tracer/bin/python -m benchmarks.peers.circuit_tracer.graphs_side
graph FOLDER nnsight`` (or ``transformerlens``); for ``d797c82``: ``.peers/circuit_tracer_d797c82/bin/python -m
benchmarks.peers.circuit_tracer.graphs_side graph FOLDER d797c82``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import yaml
from safetensors.torch import load_file, save_file

from benchmarks.harness import max_rss_mib, peak_mib, reset_peak, resident_mib


def relayout(config: dict, folder: Path) -> Path:
    """The set in circuit-tracer d797c82's layout, written to ``folder``: its ``config.yaml``.

    gradpatch exports circuit-tracer 0.5.0's layout (``W_dec`` ``[d_sae, d_model]``, ``config.yaml`` listing the
    paths); d797c82's loader reads ``{id, layer, filepath}`` entries and transposes ``W_dec`` from ``[d_model,
    d_sae]``, so ``W_dec`` is transposed here. ``W_enc`` ``[d_sae, d_model]``, ``b_enc``, ``b_dec`` and ``W_skip`` mean
    the same in both."""
    folder.mkdir(exist_ok=True)
    entries = []
    for layer, path in enumerate(config["transcoders"]):
        tensors = load_file(path)
        tensors["W_dec"] = tensors["W_dec"].T.contiguous()
        entries.append({"id": f"layer-{layer}", "layer": layer, "filepath": str(folder / f"layer_{layer}.safetensors")})
        save_file(tensors, entries[-1]["filepath"])
    (folder / "config.yaml").write_text(yaml.safe_dump({key: config[key] for key in (
        "model_name", "feature_input_hook", "feature_output_hook")} | {"transcoders": entries}))
    return folder / "config.yaml"


def hooked_transformer(folder: Path) -> tuple[Any, dict[str, torch.Tensor], Any]:
    """``(config, state dict, tokenizer)`` of a local Llama or GPT-2 folder as a TransformerLens
    ``HookedTransformer``, its weights processed as circuit-tracer's ``from_pretrained_and_transcoders`` does
    (``fold_ln``, ``center_writing_weights``, ``center_unembed`` off).

    ``HookedTransformer.from_pretrained`` (which circuit-tracer's ``from_pretrained_and_transcoders`` calls) accepts
    only names on TransformerLens's official list (``get_official_model_name`` raises ``ValueError: ... not found``
    for a folder, and SmolLM2 is not on the list of transformer-lens 2.16.1), so the config is written here as
    TransformerLens's ``convert_hf_model_config`` writes a Llama's or a GPT-2's and the weights are converted with
    its ``convert_llama_weights`` or ``convert_gpt2_weights``."""
    from transformer_lens import HookedTransformer, HookedTransformerConfig
    from transformer_lens.pretrained.weight_conversions import convert_gpt2_weights, convert_llama_weights
    from transformers import AutoModelForCausalLM, AutoTokenizer

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
    plain = HookedTransformer(config)
    plain.load_and_process_state_dict(convert(hf_model, config), fold_ln=False, center_writing_weights=False,
                                      center_unembed=False)
    return config, plain.state_dict(), AutoTokenizer.from_pretrained(str(folder))


def load_weights(model: Any, state: dict[str, torch.Tensor]) -> Any:
    """``model`` (a replacement model, whose MLPs and unembedding circuit-tracer wraps as ``old_mlp`` and
    ``old_unembed``) with the ``HookedTransformer`` weights ``state``; only the transcoders' are not in it."""
    renamed = {}
    for name in model.state_dict():
        source = name.replace(".old_mlp.", ".").replace("unembed.old_unembed.", "unembed.")
        if source in state:
            renamed[name] = state[source]
    missing, unexpected = model.load_state_dict(renamed, strict=False)
    left = [name for name in missing if not name.startswith("transcoders.")]
    if unexpected or left or len(renamed) != len(state):
        raise RuntimeError(f"weights not matched: missing {left}, unexpected {unexpected}, "
                           f"{len(state) - len(renamed)} unused")
    return model


def replacement_model(folder: Path, backend: str) -> Any:
    """circuit-tracer's replacement model of ``folder/model`` with the set ``folder/transcoders``: 0.5.0's
    ``nnsight`` or ``transformerlens`` backend (the set as gradpatch exports it), or ``d797c82`` (the
    TransformerLens-only version at that commit, the set rewritten in its layout)."""
    config_path = folder / "transcoders" / "config.yaml"
    config = yaml.safe_load(config_path.read_text())
    if backend == "d797c82":
        from circuit_tracer.replacement_model import ReplacementModel as OldReplacementModel
        from circuit_tracer.transcoder import load_transcoder_set as load_old_set

        settings = load_old_set(str(relayout(config, folder / "transcoders_d797c82")), device=torch.device("cpu"),
                                dtype=torch.float32)
        config, state, tokenizer = hooked_transformer(folder / "model")
        return load_weights(OldReplacementModel.from_config(
            config, settings.transcoders, feature_input_hook=settings.feature_input_hook,
            feature_output_hook=settings.feature_output_hook, scan=settings.scan, tokenizer=tokenizer), state)
    from circuit_tracer.transcoder.single_layer_transcoder import load_transcoder_set

    transcoders = load_transcoder_set(dict(enumerate(config["transcoders"])), "gradpatch-export",
                                      config["feature_input_hook"], config["feature_output_hook"],
                                      device=torch.device("cpu"), dtype=torch.float32, lazy_encoder=False,
                                      lazy_decoder=False)
    return with_dictionaries(folder, transcoders, backend)


def with_dictionaries(folder: Path, dictionaries: Any, backend: str) -> Any:
    """circuit-tracer 0.5.0's replacement model of ``folder/model`` over ``dictionaries`` (a transcoder set or a
    CLT) with its ``nnsight`` or ``transformerlens`` backend, on the CPU in float32."""
    from circuit_tracer import ReplacementModel

    if backend == "nnsight":
        return ReplacementModel.from_pretrained_and_transcoders(str(folder / "model"), dictionaries, backend="nnsight",
                                                                device=torch.device("cpu"), dtype=torch.float32)
    model_config, state, tokenizer = hooked_transformer(folder / "model")
    return load_weights(ReplacementModel.from_config(model_config, dictionaries, backend="transformerlens",
                                                     tokenizer=tokenizer), state)


def graph(folder: Path, backend: str = "nnsight", build: Callable[[Path, str], Any] = replacement_model) -> None:
    """circuit-tracer's graph of ``folder``'s prompt (module docstring) over the replacement model that ``build``
    makes of ``(folder, backend)`` (default: :func:`replacement_model`, the per-layer transcoder set)."""
    from circuit_tracer import attribute

    prompt = json.loads((folder / "prompt.json").read_text())
    start = time.perf_counter()
    model = build(folder, backend)
    loaded = time.perf_counter() - start
    rss_loaded = resident_mib() / 1024
    reset_peak()
    start, cpu, load = time.perf_counter(), time.process_time(), os.getloadavg()[0]
    result = attribute(torch.tensor(prompt["ids"]), model, batch_size=prompt["batch_size"], max_feature_nodes=None)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    logit_tokens = (torch.tensor([t.vocab_idx for t in result.logit_targets]) if hasattr(result, "logit_targets")
                    else result.logit_tokens)
    save_file({"adjacency": result.adjacency_matrix.float().contiguous(),
               "active_features": result.active_features.long().contiguous(),
               "activation_values": result.activation_values.float().contiguous(),
               "logit_tokens": logit_tokens.long().contiguous(),
               "logit_probabilities": result.logit_probabilities.float().contiguous()},
              str(folder / f"circuit_tracer_graph_{backend}.safetensors"))
    (folder / f"circuit_tracer_run_{backend}.json").write_text(json.dumps({
        "load_seconds": round(loaded, 2), "attribute_seconds": round(seconds, 2),
        "attribute_cpu_seconds": round(cpu, 2), "load_average_1min": [round(load, 1), round(os.getloadavg()[0], 1)],
        "rss_after_load_gib": round(rss_loaded, 3), "peak_rss_during_attribute_gib": round(peak_mib() / 1024, 3),
        "max_rss_gib": round(max_rss_mib() / 1024, 3),
        "torch_threads": torch.get_num_threads()}))


if __name__ == "__main__":
    command, path = sys.argv[1], Path(sys.argv[2])
    {"graph": graph}[command](path, *sys.argv[3:])
