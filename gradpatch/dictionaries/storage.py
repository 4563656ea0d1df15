"""A dictionary on disk: ``dictionary.safetensors`` (its ``state_dict``) + ``dictionary.json`` (its config).

Both files are written atomically (:mod:`gradpatch.files`), tensors first and JSON last with the tensors' SHA-256,
so a crash leaves the previous dictionary or a pair whose digest check fails, never a silently mismatched pair.
:func:`dictionary_from_tensors` is the one gate every loader (ours, SAELens's, sparsify's, circuit-tracer's) passes
through: it checks names, shapes and finiteness before building anything. The pair-file helpers
(:func:`check_tensors`, :func:`write_checked_pair`, :func:`read_document`, :func:`check_model_fingerprint`) are shared
with the cross-layer transcoders' files (:mod:`gradpatch.dictionaries.clt_files`).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save as save_safetensors
from torch import nn

from ..errors import FingerprintMismatchError
from ..files.atomic import atomic_write_bytes, atomic_write_text, read_json, read_tensors, sha256_hex
from ..files.fingerprint import model_fingerprint
from .errors import DictionaryConfigError, DictionaryLoadError
from .modules import ConfigT, DictionaryConfig, SparseDictionary

__all__ = ["FORMAT", "JSON_NAME", "TENSORS_NAME", "check_model_fingerprint", "check_tensors", "dictionary_from_tensors",
           "read_checked_pair",
           "expected_shapes", "load_dictionary", "read_document", "save_dictionary", "write_checked_pair"]

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
    check_tensors(tensors, shapes, source, fix, f"a {config.kind} with activation {config.activation}",
                  f"d_in={config.d_in}, d_sae={config.d_sae}, d_out={config.d_out}")
    with torch.device("meta"):
        dictionary = SparseDictionary.from_config(config)
    dtype = tensors["W_enc"].dtype
    dictionary.load_state_dict({name: tensors[name].to(dtype) for name in shapes}, assign=True)
    return dictionary


def check_tensors(tensors: Mapping[str, torch.Tensor], shapes: Mapping[str, tuple[int, ...]], source: str, fix: str,
                  what: str, widths: str) -> None:
    """Check that ``tensors`` holds exactly the tensors ``shapes`` names, each of its shape, floating and finite.

    Args:
        tensors: name -> tensor as read from a file.
        shapes: name -> the shape the config implies.
        source: the file(s) they come from, named in errors.
        fix: what the user should do, appended to every message.
        what: the object described, e.g. ``"a transcoder with activation relu"``.
        widths: the config's widths that imply the shapes, e.g. ``"d_in=64, d_sae=96, d_out=64"``.

    Raises:
        DictionaryLoadError: a tensor missing or unexpected, of another shape (a wrong width), not floating point,
            or holding NaN or ±inf.
    """
    missing, extra = sorted(set(shapes) - set(tensors)), sorted(set(tensors) - set(shapes))
    if missing or extra:
        raise DictionaryLoadError(f"{source}: {what} holds tensors {sorted(shapes)}; missing {missing}, unexpected "
                                  f"{extra}; {fix}")
    for name, shape in shapes.items():
        tensor = tensors[name]
        if tuple(tensor.shape) != shape:
            raise DictionaryLoadError(f"{source}: tensor {name!r} has shape {tuple(tensor.shape)}, but {widths} need "
                                      f"{shape}; {fix}")
        if not tensor.is_floating_point():
            raise DictionaryLoadError(f"{source}: tensor {name!r} is {tensor.dtype}, not floating point; {fix}")
        if not bool(torch.isfinite(tensor).all()):
            raise DictionaryLoadError(f"{source}: tensor {name!r} holds NaN or ±inf; {fix} (a dictionary whose "
                                      f"training diverged cannot be used)")


def write_checked_pair(directory: Path, tensors_name: str, json_name: str, tensors: Mapping[str, torch.Tensor],
                       document: dict[str, Any]) -> Path:
    """Write ``tensors`` (safetensors) and ``document`` (JSON, with the tensors' SHA-256 added as
    ``tensors_sha256``) into ``directory``, each atomically, tensors first; nothing is written if a tensor holds NaN
    or ±inf.

    Returns:
        ``directory``.

    Raises:
        DictionaryLoadError: a tensor holds NaN or ±inf (nothing is written).
    """
    tensors = {name: t.detach().contiguous().cpu().clone() for name, t in tensors.items()}
    bad = sorted(name for name, t in tensors.items() if not bool(torch.isfinite(t).all()))
    if bad:
        raise DictionaryLoadError(f"dictionary tensors {bad} hold NaN or ±inf; nothing was saved: stop the training "
                                  f"before it diverges (lower the learning rate)")
    data = save_safetensors(tensors)
    atomic_write_bytes(directory / tensors_name, data)
    atomic_write_text(directory / json_name, json.dumps({**document, "tensors_sha256": sha256_hex(data)}, indent=2))
    return directory


def read_document(json_path: Path, format_name: str, version: int, fix: str) -> dict[str, Any]:
    """The JSON document of a saved pair, checked to be of format ``format_name``, version <= ``version``, with a
    ``config`` object.

    Raises:
        DictionaryLoadError: the file is missing, unreadable, or of another format or a newer version.
    """
    document = read_json(json_path, DictionaryLoadError, fix)
    if document.get("format") != format_name or not isinstance(document.get("version"), int) \
            or document["version"] > version or not isinstance(document.get("config"), dict):
        raise DictionaryLoadError(f"{json_path} is not a {format_name} file of version <= {version}; {fix} (or "
                                  f"upgrade gradpatch)")
    return document


def check_model_fingerprint(saved: str | None, model: nn.Module | None, json_path: Path) -> None:
    """Raise :class:`~gradpatch.errors.FingerprintMismatchError` when ``model`` is given, a fingerprint ``saved`` was
    recorded in ``json_path``, and the model's differs."""
    if model is None or saved is None:
        return
    current = model_fingerprint(model)
    if current != saved:
        raise FingerprintMismatchError(
            f"{json_path} was saved for a model with fingerprint {saved}, but this model's is {current}: splice it "
            f"into the model it was trained on, or pass check_fingerprint=False")


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
    document = {"format": FORMAT, "version": VERSION, "config": config.to_dict()}
    return write_checked_pair(directory, TENSORS_NAME, JSON_NAME, dictionary.state_dict(), document)


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
    fix = "save the dictionary again with save_dictionary"
    foreign = {"sae_weights.safetensors": "SAELens: use load_saelens", "sae.safetensors": "sparsify: use load_sparsify"}
    config, tensors, path = read_checked_pair(Path(directory), (JSON_NAME, TENSORS_NAME), (FORMAT, VERSION),
                                              DictionaryConfig.from_dict, foreign, fix, model, check_fingerprint)
    return dictionary_from_tensors(config, tensors, str(path), fix)


def read_checked_pair(directory: Path, names: tuple[str, str], format_version: tuple[str, int],
                      parse: Callable[[dict[str, Any]], ConfigT], foreign: Mapping[str, str], fix: str,
                      model: nn.Module | None, check_fingerprint: bool) -> tuple[ConfigT, dict[str, torch.Tensor],
                                                                                   Path]:
    """Read a (JSON, safetensors) pair that :func:`write_checked_pair` wrote: the config, the tensors (their SHA-256
    checked against the JSON's) and the tensors' path. The one reader of :func:`load_dictionary` and
    :func:`~gradpatch.dictionaries.load_clt`.

    Args:
        directory: the folder.
        names: (JSON file name, safetensors file name).
        format_version: the JSON's ``format`` and the newest ``version`` read.
        parse: the config's ``from_dict``.
        foreign: file name -> what a folder holding it is and the loader to use (named when the JSON is missing).
        fix: what the user should do, appended to every message.
        model, check_fingerprint: the model whose fingerprint must equal the saved one (when one was saved).

    Raises:
        DictionaryLoadError: a file missing, unreadable or of another format; the two files from different saves; a
            config that does not parse.
        FingerprintMismatchError: a config saved for another model.
    """
    json_path = directory / names[0]
    if not json_path.is_file():
        for marker, what in foreign.items():
            if (directory / marker).is_file():
                raise DictionaryLoadError(f"{directory} holds no {names[0]} but looks like {what}")
    document = read_document(json_path, *format_version, fix)
    try:
        config = parse(document["config"])
    except DictionaryConfigError as error:
        raise DictionaryLoadError(f"{json_path}: {error}; {fix}") from error
    tensors = read_tensors(directory / names[1], DictionaryLoadError, fix, document.get("tensors_sha256"))
    if check_fingerprint:
        check_model_fingerprint(config.model_fingerprint, model, json_path)  # type: ignore[attr-defined]
    return config, tensors, directory / names[1]
