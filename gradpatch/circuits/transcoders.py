"""A folder of transcoders, one per layer, for an attribution graph (what ``gradpatch circuit --dictionaries DIR``
reads). Two layouts:

- gradpatch's: ``DIR/layer_{i}/`` for each spliced layer i, each a folder that
  :func:`~gradpatch.dictionaries.save_dictionary` wrote (``dictionary.json`` + ``dictionary.safetensors``), its config
  naming the NodePaths read and written; layers may be any subset (e.g. only the last few);
- circuit-tracer's: ``DIR/config.yaml`` naming one safetensors file per layer 0..L−1
  (:func:`~gradpatch.dictionaries.load_circuit_tracer`); its files record TransformerLens hook names, not NodePaths,
  so the NodePaths read and written come from templates with ``{layer}`` (``ModelLayout.template("mlp_input")`` and
  ``template("mlp")`` of the model's layout; default: the Llama family's, :data:`LLAMA_MLP_INPUT` and
  :data:`LLAMA_MLP_OUTPUT`).
"""

from __future__ import annotations

import re
from pathlib import Path

from torch import nn

from ..dictionaries import SparseDictionary, load_circuit_tracer, load_dictionary
from ..layouts import LLAMA_LAYOUT
from .errors import CircuitError

__all__ = ["LLAMA_MLP_INPUT", "LLAMA_MLP_OUTPUT", "load_transcoders"]

#: The NodePath of a Llama-family MLP's input (its ``forward(x)`` argument) and output, ``{layer}`` for the layer (the
#: layout table's).
LLAMA_MLP_INPUT = LLAMA_LAYOUT.template("mlp_input")
LLAMA_MLP_OUTPUT = LLAMA_LAYOUT.template("mlp")
_LAYER = re.compile(r"layer_(\d+)")


def load_transcoders(directory: str | Path, model: nn.Module | None = None, input_node: str = LLAMA_MLP_INPUT,
                     output_node: str = LLAMA_MLP_OUTPUT) -> dict[int, SparseDictionary]:
    """layer -> transcoder of ``directory`` (module docstring).

    Args:
        directory: the folder.
        model: the model they are for; gradpatch dictionaries that recorded another model's fingerprint are refused.
        input_node, output_node: NodePath templates with ``{layer}``, for a circuit-tracer ``config.yaml`` only.

    Raises:
        CircuitError: a folder that is missing or holds neither layout.
        DictionaryLoadError: a dictionary that cannot be read (the message names the file and the fix).
        FingerprintMismatchError: a dictionary saved for another model.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise CircuitError(f"--dictionaries {directory} is not a folder; give the folder of layer_<i>/ dictionaries "
                           f"(save_dictionary) or of a circuit-tracer config.yaml")
    if (directory / "config.yaml").is_file():
        return load_circuit_tracer(directory / "config.yaml", input_node, output_node)
    folders = {int(match.group(1)): entry for entry in directory.iterdir()
               if entry.is_dir() and (match := _LAYER.fullmatch(entry.name))}
    if not folders:
        raise CircuitError(f"{directory} holds neither layer_<i>/ folders (one save_dictionary folder per layer) nor "
                           f"a circuit-tracer config.yaml; save each layer's transcoder to {directory}/layer_<i>")
    return {layer: load_dictionary(folder, model=model) for layer, folder in sorted(folders.items())}
