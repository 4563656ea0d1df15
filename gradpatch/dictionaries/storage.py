"""A dictionary on disk: ``dictionary.safetensors`` (its ``state_dict``) + ``dictionary.json`` (its config).

Both files are written atomically (:mod:`gradpatch.files`), tensors first and JSON last with the tensors' SHA-256,
so a crash leaves the previous dictionary or a pair whose digest check fails, never a silently mismatched pair.
:func:`dictionary_from_tensors` is the one gate every loader (ours, SAELens's, sparsify's, circuit-tracer's) passes
through: it checks names, shapes and finiteness before building anything.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import save as save_safetensors
from torch import nn

from ..errors import FingerprintMismatchError
from ..files.atomic import atomic_write_bytes, atomic_write_text, read_json, read_tensors, sha256_hex
from ..files.fingerprint import model_fingerprint
from .errors import DictionaryConfigError, DictionaryLoadError
from .modules import DictionaryConfig, SparseDictionary

__all__ = ["FORMAT", "JSON_NAME", "TENSORS_NAME", "dictionary_from_tensors", "expected_shapes", "load_dictionary",
           "save_dictionary"]

FORMAT = "gradpatch.dictionary"
VERSION = 1
JSON_NAME = "dictionary.json"
TENSORS_NAME = "dictionary.safetensors"


def expected_shapes(config: DictionaryConfig) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape of a dictionary of ``config`` (its ``state_dict``)."""
    d_in, m, d_out = config.d_in, config.d_sae, int(config.d_out or config.d_in)
    shapes: dict[str, tuple[int, ...]] = {"W_enc": (d_in, m), "b_enc": (m,), "W_dec": (m, d_out), "b_dec": (d_out,)}
    if config.activation == "jumprelu":
        shapes["threshold"] = (m,)
    if config.activation == "batchtopk":
        shapes["batch_threshold"] = ()
    if config.kind == "skip_transcoder":
        shapes["W_skip"] = (d_out, d_in)
    return shapes


def dictionary_from_tensors(config: DictionaryConfig, tensors: Mapping[str, torch.Tensor], source: str,
                            fix: str) -> SparseDictionary:
    """Build a dictionary of ``config`` holding ``tensors``, after checking every one.

    Args:
        config: what the dictionary is.
        tensors: name -> tensor, named as :func:`expected_shapes` names them.
        source: the file(s) they come from, named in errors.
        fix: what the user should do, appended to every message.

    Raises:
        DictionaryLoadError: a tensor missing, unexpected, of another shape than ``config`` implies (a wrong width),
            not floating point, or holding NaN or ±inf.
    """
    shapes = expected_shapes(config)
    missing, extra = sorted(set(shapes) - set(tensors)), sorted(set(tensors) - set(shapes))
    if missing or extra:
        raise DictionaryLoadError(f"{source}: a {config.kind} with activation {config.activation} holds tensors "
                                  f"{sorted(shapes)}; missing {missing}, unexpected {extra}; {fix}")
    for name, shape in shapes.items():
        tensor = tensors[name]
        if tuple(tensor.shape) != shape:
            raise DictionaryLoadError(f"{source}: tensor {name!r} has shape {tuple(tensor.shape)}, but d_in="
                                      f"{config.d_in}, d_sae={config.d_sae}, d_out={config.d_out} need {shape}; {fix}")
        if not tensor.is_floating_point():
            raise DictionaryLoadError(f"{source}: tensor {name!r} is {tensor.dtype}, not floating point; {fix}")
        if not bool(torch.isfinite(tensor).all()):
            raise DictionaryLoadError(f"{source}: tensor {name!r} holds NaN or ±inf; {fix} (a dictionary whose "
                                      f"training diverged cannot be used)")
    with torch.device("meta"):
        dictionary = SparseDictionary.from_config(config)
    dtype = tensors["W_enc"].dtype
    dictionary.load_state_dict({name: tensors[name].to(dtype) for name in shapes}, assign=True)
    return dictionary


def save_dictionary(dictionary: SparseDictionary, directory: str | Path, model: nn.Module | None = None) -> Path:
    """Write ``dictionary`` to ``directory`` (created if missing) as ``dictionary.safetensors`` + ``dictionary.json``.

    Args:
        dictionary: any :class:`SparseDictionary`.
        directory: the folder.
        model: the model it belongs to; its fingerprint is recorded in the config (and checked on load).

    Returns:
        ``directory``.

    Raises:
        DictionaryLoadError: a parameter holds NaN or ±inf (nothing is written).
    """
    directory = Path(directory)
    config = dictionary.config
    if model is not None:
        config = dataclasses.replace(config, model_fingerprint=model_fingerprint(model))
    tensors = {name: t.detach().contiguous().cpu().clone() for name, t in dictionary.state_dict().items()}
    bad = sorted(name for name, t in tensors.items() if not bool(torch.isfinite(t).all()))
    if bad:
        raise DictionaryLoadError(f"dictionary tensors {bad} hold NaN or ±inf; nothing was saved: stop the training "
                                  f"before it diverges (lower the learning rate)")
    data = save_safetensors(tensors)
    document = {"format": FORMAT, "version": VERSION, "config": config.to_dict(), "tensors_sha256": sha256_hex(data)}
    atomic_write_bytes(directory / TENSORS_NAME, data)
    atomic_write_text(directory / JSON_NAME, json.dumps(document, indent=2))
    return directory


def load_dictionary(directory: str | Path, model: nn.Module | None = None,
                    check_fingerprint: bool = True) -> SparseDictionary:
    """Read a dictionary written by :func:`save_dictionary`, checking both files before building it.

    Args:
        directory: the folder holding ``dictionary.json`` and ``dictionary.safetensors``.
        model: the model it will be spliced into; its fingerprint must equal the saved one (when one was saved).
        check_fingerprint: ``False`` skips that comparison.

    Raises:
        DictionaryLoadError: a file missing, unreadable or of another format (an SAELens or sparsify folder names
            the loader to use); the two files from different saves; a config or tensor that does not fit.
        FingerprintMismatchError: the dictionary was trained on another model (both fingerprints named).
    """
    directory = Path(directory)
    json_path = directory / JSON_NAME
    fix = "save the dictionary again with save_dictionary"
    if not json_path.is_file():
        foreign = ("SAELens: use load_saelens" if (directory / "sae_weights.safetensors").is_file() else
                   "sparsify: use load_sparsify" if (directory / "sae.safetensors").is_file() else None)
        if foreign:
            raise DictionaryLoadError(f"{directory} holds no {JSON_NAME} but looks like {foreign}")
    document = read_json(json_path, DictionaryLoadError, fix)
    if document.get("format") != FORMAT or not isinstance(document.get("version"), int) \
            or document["version"] > VERSION or not isinstance(document.get("config"), dict):
        raise DictionaryLoadError(f"{json_path} is not a gradpatch dictionary of version <= {VERSION}; {fix} (or "
                                  f"upgrade gradpatch)")
    try:
        config = DictionaryConfig.from_dict(document["config"])
    except DictionaryConfigError as error:
        raise DictionaryLoadError(f"{json_path}: {error}; {fix}") from error
    tensors = read_tensors(directory / TENSORS_NAME, DictionaryLoadError, fix, document.get("tensors_sha256"))
    if check_fingerprint and model is not None and config.model_fingerprint is not None:
        current = model_fingerprint(model)
        if current != config.model_fingerprint:
            raise FingerprintMismatchError(
                f"{json_path} was saved for a model with fingerprint {config.model_fingerprint}, but this model's is "
                f"{current}: splice it into the model it was trained on, or pass check_fingerprint=False")
    return dictionary_from_tensors(config, tensors, str(directory / TENSORS_NAME), fix)
