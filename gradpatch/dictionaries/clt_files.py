"""A cross-layer transcoder on disk: ``clt.safetensors`` (its ``state_dict``) + ``clt.json`` (its :class:`CLTConfig`).

Written as :func:`~gradpatch.dictionaries.save_dictionary` writes a dictionary (the same helpers of
:mod:`gradpatch.dictionaries.storage`): each file atomically, tensors first, the JSON last with the tensors'
SHA-256; nothing is written when a tensor holds NaN or ±inf. :func:`clt_from_tensors` is the one gate every CLT loader
(ours and circuit-tracer's layout, :mod:`gradpatch.dictionaries.clt_circuit_tracer`) passes through: names, shapes,
dtype and finiteness are checked before anything is built.

Tensor names: ``W_enc`` ``[L, d_in, m]``, ``b_enc`` ``[L, m]``, ``W_dec.{l}`` ``[m, L − l, d_out]`` for l = 0..L−1,
``b_dec`` ``[L, d_out]``, ``threshold`` ``[L, m]`` (JumpReLU), ``W_skip`` ``[L, d_out, d_in]`` (``skip``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn

from ..files.fingerprint import model_fingerprint
from .clt import CLTConfig, CrossLayerTranscoder
from .storage import check_tensors, read_checked_pair, write_checked_pair

__all__ = ["CLT_FORMAT", "CLT_JSON_NAME", "CLT_TENSORS_NAME", "clt_from_tensors", "expected_clt_shapes", "load_clt",
           "save_clt"]

CLT_FORMAT = "gradpatch.clt"
CLT_VERSION = 1
CLT_JSON_NAME = "clt.json"
CLT_TENSORS_NAME = "clt.safetensors"


def expected_clt_shapes(config: CLTConfig) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape of a CLT of ``config`` (its ``state_dict``)."""
    n, d_in, m, d_out = config.n_layers, config.d_in, config.d_sae, int(config.d_out or config.d_in)
    shapes: dict[str, tuple[int, ...]] = {"W_enc": (n, d_in, m), "b_enc": (n, m), "b_dec": (n, d_out)}
    shapes.update({f"W_dec.{layer}": (m, n - layer, d_out) for layer in range(n)})
    if config.activation == "jumprelu":
        shapes["threshold"] = (n, m)
    if config.skip:
        shapes["W_skip"] = (n, d_out, d_in)
    return shapes


def clt_from_tensors(config: CLTConfig, tensors: Mapping[str, torch.Tensor], source: str,
                     fix: str) -> CrossLayerTranscoder:
    """Build a CLT of ``config`` holding ``tensors``, after checking every one.

    Args:
        config: what the CLT is.
        tensors: name -> tensor, named as :func:`expected_clt_shapes` names them (every one cast to ``W_enc``'s
            dtype).
        source: the file(s) they come from, named in errors.
        fix: what the user should do, appended to every message.

    Raises:
        DictionaryLoadError: a tensor missing (e.g. a decoder block ``W_dec.{l}``), unexpected, of another shape
            than ``config`` implies (a wrong width or layer count), not floating point, or holding NaN or ±inf.
    """
    shapes = expected_clt_shapes(config)
    check_tensors(tensors, shapes, source, fix, f"a CLT with activation {config.activation} and "
                  f"{'a' if config.skip else 'no'} skip term",
                  f"n_layers={config.n_layers}, d_in={config.d_in}, d_sae={config.d_sae}, d_out={config.d_out}")
    with torch.device("meta"):
        clt = CrossLayerTranscoder(config)
    dtype = tensors["W_enc"].dtype
    clt.load_state_dict({name: tensors[name].to(dtype) for name in shapes}, assign=True)
    return clt


def save_clt(clt: CrossLayerTranscoder, directory: str | Path, model: nn.Module | None = None) -> Path:
    """Write ``clt`` to ``directory`` (created if missing) as ``clt.safetensors`` + ``clt.json``.

    Args:
        clt: the cross-layer transcoder.
        directory: the folder.
        model: the model it belongs to; its fingerprint is recorded in the config (and checked on load).

    Returns:
        ``directory``.

    Raises:
        DictionaryLoadError: a parameter holds NaN or ±inf (nothing is written).
    """
    config = clt.config
    if model is not None:
        config = dataclasses.replace(config, model_fingerprint=model_fingerprint(model))
    document = {"format": CLT_FORMAT, "version": CLT_VERSION, "config": config.to_dict()}
    return write_checked_pair(Path(directory), CLT_TENSORS_NAME, CLT_JSON_NAME, clt.state_dict(), document)


def load_clt(directory: str | Path, model: nn.Module | None = None,
             check_fingerprint: bool = True) -> CrossLayerTranscoder:
    """Read a CLT written by :func:`save_clt`, checking both files before building it.

    Args:
        directory: the folder holding ``clt.json`` and ``clt.safetensors``.
        model: the model it will be spliced into; its fingerprint must equal the saved one (when one was saved).
        check_fingerprint: ``False`` skips that comparison.

    Raises:
        DictionaryLoadError: a file missing, unreadable or of another format (a circuit-tracer CLT folder or a
            per-layer dictionary names the loader to use); the two files from different saves; a config or tensor
            that does not fit (a missing decoder block, a wrong width or layer count, NaN).
        FingerprintMismatchError: the CLT was trained on another model (both fingerprints named).
    """
    fix = "save the CLT again with save_clt"
    foreign = {"W_enc_0.safetensors": "circuit-tracer's CLT layout: use load_circuit_tracer_clt",
               "dictionary.json": "a per-layer dictionary: use load_dictionary"}
    config, tensors, path = read_checked_pair(Path(directory), (CLT_JSON_NAME, CLT_TENSORS_NAME),
                                              (CLT_FORMAT, CLT_VERSION), CLTConfig.from_dict, foreign, fix, model,
                                              check_fingerprint)
    return clt_from_tensors(config, tensors, str(path), fix)
