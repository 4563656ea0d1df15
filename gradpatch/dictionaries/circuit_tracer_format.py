"""circuit-tracer's transcoder sets: a ``config.yaml`` naming one safetensors file per layer.

``config.yaml`` (circuit-tracer's ``load_transcoder_set``)::

    model_name: meta-llama/Llama-3.2-1B
    feature_input_hook: hook_resid_mid        # TransformerLens hook names
    feature_output_hook: mlp.hook_out
    transcoders:
      - {id: layer-0, layer: 0, filepath: /abs/layer_0.safetensors}

Each local file (circuit-tracer's ``load_relu_transcoder``, ReLU transcoders) holds ``W_enc`` ``[d_sae, d_model]``,
``W_dec`` ``[d_model, d_sae]`` (both transposed on load), ``b_enc`` ``[d_sae]``, ``b_dec`` ``[d_model]`` and ``W_skip``
``[d_model, d_model]`` (applied as x W_skipᵀ). Every layer 0..L−1 must have one. They load as
:class:`~gradpatch.dictionaries.SkipTranscoder` (ReLU) at NodePaths the caller names per layer; a file without
``W_skip`` loads as a plain :class:`~gradpatch.dictionaries.Transcoder`. Hugging Face ``hf://`` paths and Gemma Scope's
``.npz`` files are refused (download and convert them first). Export writes a zero ``W_skip`` for plain transcoders,
since circuit-tracer's loader reads the key unconditionally.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
import yaml
from safetensors.torch import save as save_safetensors

from ..files.atomic import atomic_write_bytes, atomic_write_text, read_tensors, read_yaml
from .errors import DictionaryConfigError, DictionaryLoadError
from .modules import DictionaryConfig, SparseDictionary
from .storage import dictionary_from_tensors

__all__ = ["CIRCUIT_TRACER_CONFIG", "export_circuit_tracer", "load_circuit_tracer"]

CIRCUIT_TRACER_CONFIG = "config.yaml"
_FIX = "give a transcoder set as circuit-tracer's load_transcoder_set reads it (config.yaml + local .safetensors)"


def _read_config(path: Path) -> list[tuple[int, Path]]:
    """(layer, file) of each transcoder of ``config.yaml``, sorted by layer.

    Raises:
        DictionaryLoadError: a missing file, unreadable YAML, missing keys, a remote or ``.npz`` file, a repeated or
            missing layer.
    """
    entries = read_yaml(path, DictionaryLoadError, _FIX).get("transcoders")
    if not isinstance(entries, list) or not entries:
        raise DictionaryLoadError(f"{path} has no 'transcoders' list; {_FIX}")
    files: dict[int, Path] = {}
    for entry in entries:
        layer, filepath = (entry.get("layer"), entry.get("filepath")) if isinstance(entry, dict) else (None, None)
        if not isinstance(layer, int) or not isinstance(filepath, str):
            raise DictionaryLoadError(f"{path}: transcoder entry {entry!r} needs an int 'layer' and a 'filepath'")
        if filepath.startswith("hf://") or filepath.endswith(".npz"):
            raise DictionaryLoadError(f"{path}: layer {layer} is {filepath}; gradpatch reads local .safetensors "
                                      f"files only: download (and convert) it first and point filepath at it")
        if layer in files:
            raise DictionaryLoadError(f"{path}: layer {layer} has two transcoders")
        file = Path(filepath)
        files[layer] = file if file.is_absolute() else path.parent / file
    if set(files) != set(range(max(files) + 1)):
        raise DictionaryLoadError(f"{path}: layers {sorted(files)}; circuit-tracer needs one transcoder for every "
                                  f"layer 0..{max(files)}")
    return sorted(files.items())


def load_circuit_tracer(config_path: str | Path, input_node: str, output_node: str) -> dict[int, SparseDictionary]:
    """Read a circuit-tracer transcoder set.

    Args:
        config_path: its ``config.yaml``. Relative ``filepath``s are read relative to its folder.
        input_node: the NodePath each layer's transcoder reads, with ``{layer}`` for the layer index, e.g.
            ``"model.layers_{layer}.post_attention_layernorm.output"``.
        output_node: the NodePath it predicts, e.g. ``"model.layers_{layer}.mlp.output"``.

    Returns:
        layer -> ReLU (skip) transcoder, in layer order.

    Raises:
        DictionaryLoadError: a missing or unreadable ``config.yaml`` or layer file, a remote or ``.npz`` file, a
            repeated or missing layer, a missing or extra tensor, mismatched widths, NaN or ±inf.
    """
    transcoders = {}
    for layer, file in _read_config(Path(config_path)):
        tensors = dict(read_tensors(file, DictionaryLoadError, _FIX))
        if "W_enc" not in tensors or tensors["W_enc"].dim() != 2:
            raise DictionaryLoadError(f"{file}: no 2-d tensor 'W_enc' [d_sae, d_model]; {_FIX}")
        d_sae, d_model = tensors["W_enc"].shape
        kind = "skip_transcoder" if "W_skip" in tensors else "transcoder"
        config = DictionaryConfig(kind, "relu", d_model, d_sae, input_node=input_node.format(layer=layer),
                                  output_node=output_node.format(layer=layer))
        tensors["W_enc"] = tensors["W_enc"].T.contiguous()
        if "W_dec" in tensors:
            tensors["W_dec"] = tensors["W_dec"].T.contiguous()
        transcoders[layer] = dictionary_from_tensors(config, tensors, str(file), _FIX)
    return transcoders


def export_circuit_tracer(transcoders: Mapping[int, SparseDictionary], directory: str | Path, model_name: str,
                          feature_input_hook: str, feature_output_hook: str) -> Path:
    """Write ReLU transcoders as a circuit-tracer set: ``layer_{i}.safetensors`` and ``config.yaml`` (absolute
    ``filepath``s, as circuit-tracer opens them relative to its working directory). Files are written atomically,
    ``config.yaml`` last.

    Args:
        transcoders: layer -> ReLU :class:`Transcoder` / :class:`SkipTranscoder` with ``d_in == d_out``, for every
            layer 0..L−1.
        directory: the folder (created if missing).
        model_name: the Hugging Face model name circuit-tracer loads.
        feature_input_hook, feature_output_hook: the TransformerLens hook names read and written.

    Returns:
        the path of ``config.yaml``.

    Raises:
        DictionaryConfigError: a layer missing, a dictionary that is not a ReLU transcoder, or ``d_in != d_out``.
    """
    directory = Path(directory).resolve()
    if not transcoders or set(transcoders) != set(range(max(transcoders) + 1)):
        raise DictionaryConfigError(f"circuit-tracer needs a transcoder for every layer 0..L-1, got layers "
                                    f"{sorted(transcoders)}")
    entries = []
    for layer, transcoder in sorted(transcoders.items()):
        config = transcoder.config
        if config.kind == "sae" or config.activation != "relu" or config.d_in != config.d_out:
            raise DictionaryConfigError(f"layer {layer}: circuit-tracer's local files hold ReLU transcoders with "
                                        f"d_in == d_out, not a {config.kind} with activation {config.activation}, "
                                        f"d_in={config.d_in}, d_out={config.d_out}")
        state = {name: t.detach().cpu() for name, t in transcoder.state_dict().items()}
        skip = state.get("W_skip", torch.zeros(config.d_in, config.d_in, dtype=state["W_enc"].dtype))
        tensors = {"W_enc": state["W_enc"].T.contiguous(), "W_dec": state["W_dec"].T.contiguous(),
                   "b_enc": state["b_enc"].contiguous(), "b_dec": state["b_dec"].contiguous(),
                   "W_skip": skip.contiguous()}
        file = atomic_write_bytes(directory / f"layer_{layer}.safetensors", save_safetensors(tensors))
        entries.append({"id": f"layer-{layer}", "layer": layer, "filepath": str(file)})
    document = {"model_name": model_name, "feature_input_hook": feature_input_hook,
                "feature_output_hook": feature_output_hook, "transcoders": entries}
    return atomic_write_text(directory / CIRCUIT_TRACER_CONFIG, yaml.safe_dump(document, sort_keys=False))
