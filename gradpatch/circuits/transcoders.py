"""A folder of transcoders, one per layer, for an attribution graph (what ``gradpatch circuit --dictionaries DIR``
reads). Three layouts:

- gradpatch's: ``DIR/layer_{i}/`` for each spliced layer i, each a folder that
  :func:`~gradpatch.dictionaries.save_dictionary` wrote (``dictionary.json`` + ``dictionary.safetensors``), its config
  naming the NodePaths read and written; layers may be any subset (e.g. only the last few);
- what ``gradpatch fit`` writes: its output folder ``D`` or ``D/dictionary``, holding one dictionary
  (``dictionary.json`` there) or one folder per node (``D/dictionary/<written node>/``); each transcoder goes to the
  layer whose MLP output it writes: its config's ``output_node`` read through the ``output_node`` template
  (``ModelLayout.template("mlp")`` of the model's layout, :func:`~gradpatch.layouts.detect_layout`);
- circuit-tracer's: ``DIR/config.yaml`` naming one safetensors file per layer 0..L−1
  (:func:`~gradpatch.dictionaries.load_circuit_tracer`); its files record TransformerLens hook names, not NodePaths,
  so the NodePaths read and written come from templates with ``{layer}`` (``ModelLayout.template("mlp_input")`` and
  ``template("mlp")`` of the model's layout; default: the Llama family's, :data:`LLAMA_MLP_INPUT` and
  :data:`LLAMA_MLP_OUTPUT`).

A folder holding a cross-layer transcoder gives it whole (a :class:`~gradpatch.dictionaries.CrossLayerTranscoder`,
which :class:`~gradpatch.circuits.ReplacementModel` takes in place of the per-layer mapping): gradpatch's
``clt.json`` + ``clt.safetensors`` (:func:`~gradpatch.dictionaries.save_clt`), or circuit-tracer's
``W_enc_{i}.safetensors`` + ``W_dec_{i}.safetensors`` without a ``config.yaml``
(:func:`~gradpatch.dictionaries.load_circuit_tracer_clt`, NodePaths from the same templates).
"""

from __future__ import annotations

import re
from pathlib import Path

from torch import nn

from ..dictionaries import (CrossLayerTranscoder, SparseDictionary, load_circuit_tracer, load_circuit_tracer_clt,
                            load_clt, load_dictionary)
from ..dictionaries.clt_files import CLT_JSON_NAME
from ..dictionaries.storage import JSON_NAME
from ..layouts import LLAMA_LAYOUT
from .errors import CircuitError

__all__ = ["LLAMA_MLP_INPUT", "LLAMA_MLP_OUTPUT", "load_transcoders"]

#: The NodePath of a Llama-family MLP's input (its ``forward(x)`` argument) and output, ``{layer}`` for the layer (the
#: layout table's).
LLAMA_MLP_INPUT = LLAMA_LAYOUT.template("mlp_input")
LLAMA_MLP_OUTPUT = LLAMA_LAYOUT.template("mlp")
_LAYER = re.compile(r"layer_(\d+)")
_FIT_FOLDER = "dictionary"


def _layer_of(node: str | None, output_node: str) -> int | None:
    """The layer ``{layer}`` stands for where ``node`` fits the template ``output_node``, else ``None``."""
    pattern = re.escape(output_node).replace(re.escape("{layer}"), r"(\d+)")
    match = re.fullmatch(pattern, node or "")
    return int(match.group(1)) if match else None


def _by_layer(dictionaries: dict[Path, SparseDictionary], output_node: str) -> dict[int, SparseDictionary]:
    """layer -> transcoder of ``gradpatch fit``'s dictionaries, each placed by the MLP output it writes.

    Raises:
        CircuitError: a sparse autoencoder, a transcoder that writes no MLP output of the layout, or two for a layer.
    """
    layers: dict[int, tuple[Path, SparseDictionary]] = {}
    for folder, dictionary in sorted(dictionaries.items()):
        config = dictionary.config
        if config.kind == "sae":
            raise CircuitError(f"{folder} holds a sparse autoencoder of {config.input_node}; an attribution graph "
                               f"needs transcoders from each MLP's input to its output: train kind: transcoder (or "
                               f"skip_transcoder) with output_node at {output_node}")
        layer = _layer_of(config.output_node, output_node)
        if layer is None:
            raise CircuitError(f"{folder}'s transcoder writes {config.output_node}, which is not an MLP output of this "
                               f"model's layout ({output_node} with {{layer}} a block index): train it with that "
                               f"output_node, or give --output-node the template it writes")
        if layer in layers:
            raise CircuitError(f"{layers[layer][0]} and {folder} both write layer {layer}'s MLP output "
                               f"({config.output_node}); keep one of them")
        layers[layer] = (folder, dictionary)
    return {layer: dictionary for layer, (_, dictionary) in sorted(layers.items())}


def _fit_folders(directory: Path) -> list[Path] | None:
    """The dictionary folders of ``gradpatch fit``'s output ``directory`` (or its ``dictionary/``), else ``None``."""
    for root in (directory / _FIT_FOLDER, directory):
        if (root / JSON_NAME).is_file():
            return [root]
        if root.is_dir():
            found = sorted(entry for entry in root.iterdir() if (entry / JSON_NAME).is_file())
            if found:
                return found
    return None


def load_transcoders(directory: str | Path, model: nn.Module | None = None, input_node: str = LLAMA_MLP_INPUT,
                     output_node: str = LLAMA_MLP_OUTPUT) -> dict[int, SparseDictionary] | CrossLayerTranscoder:
    """layer -> transcoder of ``directory``, or the cross-layer transcoder it holds (module docstring).

    Args:
        directory: the folder.
        model: the model they are for; gradpatch dictionaries that recorded another model's fingerprint are refused.
        input_node: NodePath template with ``{layer}`` of the MLP inputs, for circuit-tracer's layouts only.
        output_node: NodePath template with ``{layer}`` of the MLP outputs: the NodePaths of a circuit-tracer set's
            outputs, and the layer of each transcoder ``gradpatch fit`` wrote (the layout's ``template("mlp")``).

    Raises:
        CircuitError: a folder that is missing or holds none of the layouts; a ``gradpatch fit`` dictionary that is
            a sparse autoencoder, writes no MLP output of ``output_node``, or writes a layer another one writes; a
            ``layer_<i>/`` transcoder that writes another layer's MLP output.
        DictionaryLoadError: a dictionary or CLT that cannot be read (the message names the file and the fix).
        FingerprintMismatchError: a dictionary saved for another model.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise CircuitError(f"--dictionaries {directory} is not a folder; give the folder of layer_<i>/ dictionaries "
                           f"(save_dictionary), gradpatch fit's output folder, or a circuit-tracer config.yaml's")
    if (directory / CLT_JSON_NAME).is_file():
        return load_clt(directory, model=model)
    if (directory / "config.yaml").is_file():
        return load_circuit_tracer(directory, input_node, output_node)
    if (directory / "W_enc_0.safetensors").is_file():
        return load_circuit_tracer_clt(directory, input_node, output_node)
    folders = {int(match.group(1)): entry for entry in directory.iterdir()
               if entry.is_dir() and (match := _LAYER.fullmatch(entry.name))}
    if folders:
        transcoders = {layer: load_dictionary(folder, model=model) for layer, folder in sorted(folders.items())}
        for layer, transcoder in transcoders.items():
            written = _layer_of(transcoder.config.output_node, output_node)
            if written is not None and written != layer:
                raise CircuitError(f"{directory}/layer_{layer} holds a transcoder of layer {written}'s MLP output "
                                   f"({transcoder.config.output_node}); save it to layer_{written}")
        return transcoders
    fitted = _fit_folders(directory)
    if fitted is None:
        raise CircuitError(f"{directory} holds neither layer_<i>/ folders (one save_dictionary folder per layer), "
                           f"gradpatch fit's dictionary/ folder, nor a circuit-tracer config.yaml; save each layer's "
                           f"transcoder to {directory}/layer_<i>")
    return _by_layer({folder: load_dictionary(folder, model=model) for folder in fitted}, output_node)
