"""circuit-tracer's transcoder sets: a ``config.yaml`` and one safetensors file per layer 0..L−1.

The ``config.yaml`` forms read (circuit-tracer 0.5.0's ``utils/hf_utils.py`` ``load_transcoders`` /
``resolve_transcoder_paths`` and ``utils/caching.py`` ``load_transcoders_from_cache``, and the older form)::

    model_kind: transcoder_set                 # 0.5.0, a list: layer i is the i-th file
    feature_input_hook: hook_resid_mid         # TransformerLens hook names
    feature_output_hook: hook_mlp_out
    scan: my-transcoders
    transcoders: [/abs/layer_0.safetensors, layer_1.safetensors]

    model_kind: transcoder_set                 # 0.5.0's cache / repository form: no list, the files
    feature_input_hook: ...                    # layer_<i>.safetensors beside config.yaml

    transcoders:                               # the older form (circuit-tracer d797c82)
      - {id: layer-0, layer: 0, filepath: /abs/layer_0.safetensors}

Relative paths are read relative to the folder of ``config.yaml``. ``hf://`` paths and Gemma Scope's ``.npz`` files
are refused (download and convert them first); ``model_kind: cross_layer_transcoder`` (and a folder of
``W_enc_<i>.safetensors``) is a cross-layer transcoder, which
:func:`gradpatch.dictionaries.load_circuit_tracer_clt` reads. The files' tensor layouts (0.5.0's, d797c82's, Gemma
Scope 2's) are :mod:`~gradpatch.dictionaries.circuit_tracer_tensors`'s; an optional ``layout:`` field
(``latent_rows`` / ``latent_columns``) decides ``W_dec``'s orientation for files that leave it open.

Export writes 0.5.0's form: ``layer_<i>.safetensors`` in 0.5.0's layout (``W_dec`` ``[d_sae, d_model]``, metadata
``decoder_layout: latent_rows``) and ``config.yaml`` with ``model_kind``, the hooks, ``scan``, ``model_name`` and the
absolute paths, so that both 0.5.0's ``load_transcoders`` (the list) and its cache loader (``layer_<i>`` files) read it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from safetensors.torch import save as save_safetensors

from ..files.atomic import atomic_write_bytes, atomic_write_text, read_yaml
from .circuit_tracer_tensors import DECODER_LAYOUTS, circuit_tracer_tensors, read_circuit_tracer_file
from .errors import DictionaryConfigError, DictionaryLoadError
from .modules import SparseDictionary

__all__ = ["CIRCUIT_TRACER_CONFIG", "export_circuit_tracer", "load_circuit_tracer"]

CIRCUIT_TRACER_CONFIG = "config.yaml"
_FIX = "give a transcoder set as circuit-tracer's load_transcoders reads it (config.yaml + local .safetensors)"
_CLT = ("is a cross-layer transcoder (circuit-tracer's W_enc_<i>.safetensors / W_dec_<i>.safetensors), not a set of "
        "per-layer transcoders: read it with gradpatch.dictionaries.load_circuit_tracer_clt")
_LAYER_FILE = re.compile(r"layer_(\d+)\.safetensors")


def _local(path: Path, layer: int, filepath: str) -> Path:
    """The local file of ``filepath`` (relative to ``path``'s folder).

    Raises:
        DictionaryLoadError: a Hugging Face ``hf://`` path or a Gemma Scope ``.npz`` file.
    """
    if filepath.startswith("hf://"):
        raise DictionaryLoadError(f"{path}: layer {layer} is {filepath}; gradpatch reads local .safetensors files "
                                  f"only: download it first (huggingface_hub's hf_hub_download, or circuit-tracer's "
                                  f"save_transcoders_to_cache, which writes a local config.yaml + layer_<i> files) "
                                  f"and put the local path in config.yaml")
    if filepath.endswith(".npz"):
        raise DictionaryLoadError(f"{path}: layer {layer} is {filepath}, a Gemma Scope .npz file; convert it to "
                                  f"circuit-tracer's safetensors layout first (circuit-tracer's "
                                  f"save_transcoders_to_cache does) and point config.yaml at the result")
    file = Path(filepath)
    return file if file.is_absolute() else path.parent / file


def _listed(path: Path, entries: list[Any]) -> dict[int, Path]:
    """layer -> file of a ``transcoders`` list: 0.5.0's paths (layer = index) or the older ``{layer, filepath}``s."""
    files: dict[int, Path] = {}
    for index, entry in enumerate(entries):
        if isinstance(entry, str):
            layer, filepath = index, entry
        elif isinstance(entry, dict) and isinstance(entry.get("layer"), int) and isinstance(entry.get("filepath"), str):
            layer, filepath = entry["layer"], entry["filepath"]
        else:
            raise DictionaryLoadError(f"{path}: transcoder entry {entry!r} is neither a path (circuit-tracer 0.5.0) "
                                      f"nor a mapping with an int 'layer' and a 'filepath' (the older form)")
        if layer in files:
            raise DictionaryLoadError(f"{path}: layer {layer} has two transcoders")
        files[layer] = _local(path, layer, filepath)
    return files


def _beside(path: Path) -> dict[int, Path]:
    """layer -> ``layer_<i>.safetensors`` beside ``config.yaml`` (0.5.0's cache form)."""
    files = {int(match.group(1)): entry for entry in path.parent.iterdir()
             if (match := _LAYER_FILE.fullmatch(entry.name))}
    if not files:
        raise DictionaryLoadError(f"{path} lists no 'transcoders' and its folder holds no layer_<i>.safetensors; "
                                  f"{_FIX}")
    return files


def _read_config(path: Path) -> tuple[list[tuple[int, Path]], str | None]:
    """(layer, file) of each transcoder of ``config.yaml``, sorted by layer, and its ``layout`` field.

    Raises:
        DictionaryLoadError: a missing file, unreadable YAML, an unknown ``model_kind`` or a cross-layer transcoder,
            a malformed entry, a remote or ``.npz`` file, a repeated or missing layer.
    """
    document = read_yaml(path, DictionaryLoadError, _FIX)
    kind = document.get("model_kind", "transcoder_set")
    if kind == "cross_layer_transcoder":
        raise DictionaryLoadError(f"{path} {_CLT}")
    if kind != "transcoder_set":
        raise DictionaryLoadError(f"{path}: model_kind {kind!r} is neither 'transcoder_set' nor "
                                  f"'cross_layer_transcoder'; {_FIX}")
    entries = document.get("transcoders")
    if entries is None:
        files = _beside(path)
    elif isinstance(entries, list) and entries:
        files = _listed(path, entries)
    else:
        raise DictionaryLoadError(f"{path}: 'transcoders' is {entries!r}, not a non-empty list; {_FIX}")
    if set(files) != set(range(max(files) + 1)):
        raise DictionaryLoadError(f"{path}: layers {sorted(files)}; circuit-tracer needs one transcoder for every "
                                  f"layer 0..{max(files)}")
    layout = document.get("layout")
    if layout is not None and layout not in DECODER_LAYOUTS:
        raise DictionaryLoadError(f"{path}: layout {layout!r} is not one of {DECODER_LAYOUTS}")
    return sorted(files.items()), layout


def _config_path(config_path: str | Path) -> Path:
    """``config.yaml`` of ``config_path`` (the file, or the folder holding it).

    Raises:
        DictionaryLoadError: a folder of a cross-layer transcoder without ``config.yaml``.
    """
    path = Path(config_path)
    if not path.is_dir():
        return path
    if not (path / CIRCUIT_TRACER_CONFIG).is_file() and (path / "W_enc_0.safetensors").is_file():
        raise DictionaryLoadError(f"{path} {_CLT}")
    return path / CIRCUIT_TRACER_CONFIG


def load_circuit_tracer(config_path: str | Path, input_node: str, output_node: str,
                        layout: str | None = None) -> dict[int, SparseDictionary]:
    """Read a circuit-tracer transcoder set (module docstring), every file checked before anything is built.

    Args:
        config_path: its ``config.yaml`` (or the folder holding it).
        input_node: the NodePath each layer's transcoder reads, with ``{layer}`` for the layer index, e.g.
            ``"model.layers_{layer}.post_attention_layernorm.output"``.
        output_node: the NodePath it predicts, e.g. ``"model.layers_{layer}.mlp.output"``.
        layout: ``"latent_rows"`` (``W_dec`` ``[d_sae, d_model]``, circuit-tracer 0.5.0) or ``"latent_columns"``
            (``[d_model, d_sae]``, circuit-tracer d797c82), for files whose shapes (``d_sae == d_model``) and
            metadata leave it open; ``None``: ``config.yaml``'s ``layout`` field, else each file decides.

    Returns:
        layer -> ReLU or JumpReLU (skip) transcoder, in layer order.

    Raises:
        DictionaryLoadError: a missing or unreadable ``config.yaml`` or layer file, a cross-layer transcoder (naming
            :func:`~gradpatch.dictionaries.load_circuit_tracer_clt`), a remote or ``.npz`` file, a repeated or missing
            layer, a missing or extra tensor, mismatched widths, NaN or ±inf, ``layout`` disagreeing with the config,
            or a ``W_dec`` whose orientation nothing decides (the message says how to decide).
    """
    path = _config_path(config_path)
    files, configured = _read_config(path)
    if layout is not None and configured is not None and layout != configured:
        raise DictionaryLoadError(f"{path} says layout {configured!r} but layout={layout!r} was given; give one")
    return {layer: read_circuit_tracer_file(file, input_node.format(layer=layer), output_node.format(layer=layer),
                                            layout or configured)
            for layer, file in files}


def export_circuit_tracer(transcoders: Mapping[int, SparseDictionary], directory: str | Path, model_name: str,
                          feature_input_hook: str, feature_output_hook: str, scan: str | None = None) -> Path:
    """Write transcoders as a circuit-tracer 0.5.0 set (module docstring): ``layer_{i}.safetensors`` and
    ``config.yaml`` (absolute paths, as circuit-tracer opens them relative to its working directory). Files are
    written atomically, ``config.yaml`` last.

    Args:
        transcoders: layer -> ReLU or JumpReLU :class:`Transcoder` / :class:`SkipTranscoder` with ``d_in == d_out``
            and one number of latents, for every layer 0..L−1. When some have a skip term, the others get a zero
            ``W_skip`` (circuit-tracer's set has one or none).
        directory: the folder (created if missing).
        model_name: the Hugging Face model name circuit-tracer loads.
        feature_input_hook, feature_output_hook: the TransformerLens hook names read and written.
        scan: circuit-tracer's name of the set (its graphs' ``metadata.scan``); default: ``model_name``.

    Returns:
        the path of ``config.yaml``.

    Raises:
        DictionaryConfigError: a layer missing, a dictionary that is not a ReLU or JumpReLU transcoder,
            ``d_in != d_out``, or layers with different numbers of latents.
    """
    directory = Path(directory).resolve()
    if not transcoders or set(transcoders) != set(range(max(transcoders) + 1)):
        raise DictionaryConfigError(f"circuit-tracer needs a transcoder for every layer 0..L-1, got layers "
                                    f"{sorted(transcoders)}")
    widths = {layer: transcoder.config.d_sae for layer, transcoder in transcoders.items()}
    if len(set(widths.values())) > 1:
        raise DictionaryConfigError(f"circuit-tracer's TranscoderSet needs one d_sae for every layer, got {widths}")
    skip = any(transcoder.config.kind == "skip_transcoder" for transcoder in transcoders.values())
    written = [circuit_tracer_tensors(layer, transcoder, skip) for layer, transcoder in sorted(transcoders.items())]
    paths = [str(atomic_write_bytes(directory / f"layer_{layer}.safetensors", save_safetensors(tensors, metadata)))
             for layer, (tensors, metadata) in enumerate(written)]
    document = {"model_kind": "transcoder_set", "model_name": model_name, "scan": scan or model_name,
                "feature_input_hook": feature_input_hook, "feature_output_hook": feature_output_hook,
                "transcoders": paths}
    return atomic_write_text(directory / CIRCUIT_TRACER_CONFIG, yaml.safe_dump(document, sort_keys=False))
