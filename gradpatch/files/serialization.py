"""Saving a PatchableGraph without pickle: one safetensors file, with JSON metadata.

The file holds the example inputs (tensors, plus JSON for the constants around them), optionally the model's
weights, and as JSON: the model's class and fingerprint and the extraction options. Loading needs the model
object itself (code is never stored): ``PatchableGraph.load(path, model)`` with ``model`` built the usual way
(for transformers, ``AutoModelForCausalLM.from_config(config)`` or ``from_pretrained``); the saved weights, if
any, are loaded into it, the fingerprint is checked, and the graphs are extracted again from the saved example.

Custom extraction functions and postprocessing functions are code: they are recorded by name, and ``load``
needs them passed again in ``options=``.
"""

from __future__ import annotations

import importlib
import json
import os
import struct
import tempfile
from pathlib import Path
from typing import IO, Any, Union

import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors
from torch import nn

from .fingerprint import model_fingerprint
from ..extraction.options import ExtractionOptions

FORMAT = "gradpatch.graph"
VERSION = 1
FileLike = Union[str, os.PathLike, IO[bytes]]


def graph_bytes(model: nn.Module, options: ExtractionOptions, example: tuple[tuple, dict], weights: bool) -> bytes:
    """The file contents for a PatchableGraph over ``model`` built with ``options`` on ``example``.

    Raises:
        ValueError: an example input that is neither a tensor, a JSON value nor a container of those; or
            ``weights=True`` for a model whose weights are not all in memory (meta tensors of an offloaded model).
    """
    tensors: dict[str, torch.Tensor] = {}
    args, kwargs = example
    document: dict[str, Any] = {
        "format": FORMAT, "version": VERSION,
        "model_class": _qualified_name(type(model)),
        "model_fingerprint": model_fingerprint(model),
        "options": _encode_options(options),
        "args": [_encode(value, f"example.args.{index}", tensors) for index, value in enumerate(args)],
        "kwargs": {name: _encode(value, f"example.kwargs.{name}", tensors) for name, value in kwargs.items()},
        "training": model.training,
        "weights": {},
    }
    if weights:
        seen: dict[int, str] = {}
        for name, tensor in model.state_dict(keep_vars=True).items():
            if tensor.is_meta:
                raise ValueError(f"weight '{name}' is on the meta device (offloaded by accelerate): save with "
                                 f"weights=False and load with the dispatched model")
            key = seen.setdefault(id(tensor), f"model.{name}")
            document["weights"][name] = key
            if key not in tensors:
                tensors[key] = tensor.detach().contiguous().cpu()
    return save_tensors(tensors, metadata={"gradpatch": json.dumps(document)})


def write(file: FileLike, data: bytes) -> None:
    """Write ``data`` to a path atomically (temporary file, then rename) or to an open binary file."""
    if isinstance(file, (str, os.PathLike)):
        path = Path(file)
        handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        try:
            with os.fdopen(handle, "wb") as stream:
                stream.write(data)
            os.replace(temporary, path)
        except BaseException:
            Path(temporary).unlink(missing_ok=True)
            raise
    else:
        file.write(data)


def read(file: FileLike, model: nn.Module, options: ExtractionOptions | None,
         check_fingerprint: bool) -> tuple[ExtractionOptions, tuple, dict]:
    """Load a file written by :func:`graph_bytes` into ``model``; returns ``(options, example args, kwargs)``.

    Raises:
        ValueError: not a gradpatch graph file, a model of another class, a fingerprint mismatch (after loading
            any saved weights), or saved custom functions without ``options``.
    """
    data = Path(file).read_bytes() if isinstance(file, (str, os.PathLike)) else file.read()
    document = _metadata(data)
    if document.get("format") != FORMAT or document.get("version", 0) > VERSION:
        raise ValueError(f"{_describe(file)} is not a gradpatch graph file of version <= {VERSION}")
    if document["model_class"] != _qualified_name(type(model)):
        raise ValueError(f"{_describe(file)} was saved for a {document['model_class']}, not a "
                         f"{_qualified_name(type(model))}: pass a model of the saved class")
    tensors = load_tensors(data)
    if document["weights"]:
        model.load_state_dict({name: tensors[key] for name, key in document["weights"].items()})
    if check_fingerprint and document["model_fingerprint"] != model_fingerprint(model):
        raise ValueError(f"{_describe(file)} was saved for a model with fingerprint {document['model_fingerprint']}, "
                         f"this one has {model_fingerprint(model)}; pass the same weights, or "
                         f"check_fingerprint=False to load anyway")
    model.train(document["training"])
    saved = document["options"]
    if options is None:
        if saved["custom_extraction_functions"] or saved["postprocessing_function"]:
            raise ValueError(f"{_describe(file)} was extracted with custom functions "
                             f"{saved['custom_extraction_functions'] or saved['postprocessing_function']}, which "
                             f"are code: pass options=ExtractionOptions(...) with them again")
        options = _decode_options(saved)
    args = tuple(_decode(value, tensors) for value in document["args"])
    kwargs = {name: _decode(value, tensors) for name, value in document["kwargs"].items()}
    return options, args, kwargs


def _metadata(data: bytes) -> dict[str, Any]:
    """The gradpatch JSON in a safetensors file's header (8-byte little-endian length, then JSON)."""
    try:
        (length,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8:8 + length])
        return json.loads(header["__metadata__"]["gradpatch"])
    except (struct.error, ValueError, KeyError, TypeError) as error:
        raise ValueError(f"not a gradpatch graph file (safetensors with gradpatch metadata): {error}") from error


def _encode(value: Any, key: str, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        tensors[key] = value.detach().contiguous().cpu()
        return {"tensor": key, "device": str(value.device)}
    if isinstance(value, (tuple, list)):
        return {"tuple" if isinstance(value, tuple) else "list":
                [_encode(item, f"{key}.{index}", tensors) for index, item in enumerate(value)]}
    if isinstance(value, dict) and all(isinstance(name, str) for name in value):
        return {"dict": {name: _encode(item, f"{key}.{name}", tensors) for name, item in value.items()}}
    if value is None or isinstance(value, (bool, int, float, str)):
        return {"value": value}
    raise ValueError(f"example input {key} is a {type(value).__name__}, which cannot be saved without pickle; "
                     f"build the PatchableGraph with tensors and JSON values (numbers, strings, None) as inputs")


def _decode(encoded: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Any:
    if "tensor" in encoded:
        return tensors[encoded["tensor"]].to(encoded["device"])
    if "tuple" in encoded:
        return tuple(_decode(item, tensors) for item in encoded["tuple"])
    if "list" in encoded:
        return [_decode(item, tensors) for item in encoded["list"]]
    if "dict" in encoded:
        return {name: _decode(item, tensors) for name, item in encoded["dict"].items()}
    return encoded["value"]


def _encode_options(options: ExtractionOptions) -> dict[str, Any]:
    return {
        "allow_unused_submodules": options.allow_unused_submodules,
        "classes_to_skip_compiling": sorted(_qualified_name(cls) for cls in options.classes_to_skip_compiling),
        "copy_transformers_generation_config": options.copy_transformers_generation_config,
        "custom_extraction_functions": sorted(_qualified_name(cls) for cls in options.custom_extraction_functions),
        "error_on_compilation_failure": options.error_on_compilation_failure,
        "postprocessing_function": None if options.postprocessing_function is None
        else getattr(options.postprocessing_function, "__qualname__", repr(options.postprocessing_function)),
        "skip_compilation": options.skip_compilation,
        "warn_on_compilation_failure": options.warn_on_compilation_failure,
    }


def _decode_options(saved: dict[str, Any]) -> ExtractionOptions:
    flags = {name: value for name, value in saved.items()
             if name not in ("classes_to_skip_compiling", "custom_extraction_functions", "postprocessing_function")}
    return ExtractionOptions(classes_to_skip_compiling=frozenset(_import(name)
                                                                 for name in saved["classes_to_skip_compiling"]),
                             **flags)


def _qualified_name(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _import(qualified: str) -> type:
    module, _, name = qualified.partition(":")
    value: Any = importlib.import_module(module)
    for part in name.split("."):
        value = getattr(value, part)
    return value


def _describe(file: FileLike) -> str:
    return str(file) if isinstance(file, (str, os.PathLike)) else "the file"
