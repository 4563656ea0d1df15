"""The files of saved edits: ``edit.safetensors`` (the factors) and ``edit.json`` (NodePaths, request, fingerprint,
hyperparameters, the tensors file's SHA-256) — never pickled.

Both files are written atomically (:mod:`gradpatch.files.atomic`), the JSON last, and every field, factor shape and the
digest are checked on reading, raising :class:`~editors.errors.EditLoadError` naming the file. :mod:`editors.edits.edit`
turns the records into :class:`~editors.edits.edit.Edit` objects.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save as save_safetensors

from gradpatch.files.atomic import atomic_write_bytes, atomic_write_text, read_json, read_tensors, sha256_hex
from gradpatch.finite import check_finite

from ..errors import EditLoadError
from ..requests import EditRequest

__all__ = ["FORMAT", "VERSION", "factor_shapes", "read_edit_files", "write_edit_files"]

FORMAT = "gradpatch.rome-edit"
#: 2: the SHA-256 of edit.safetensors in edit.json; 3: rank-r factors (``"rank"`` in a record). Older files still
#: load.
VERSION = 3
_LOAD_FIX = "save the edits again with Edit.save or editors.save_edits"


def write_edit_files(path: str | os.PathLike[str], records: Sequence[dict[str, Any]],
                     factors: Sequence[tuple[torch.Tensor, torch.Tensor]], batch: dict[str, Any] | None = None) -> Path:
    """Write ``path/edit.safetensors`` (factor ``i`` as tensors ``"{i}.u"``, ``"{i}.v"``), then ``path/edit.json``.

    Args:
        path: the directory (created if missing).
        records: one JSON record per edit (:meth:`editors.edits.edit.Edit.to_json`).
        factors: ``(u, v)`` per edit: ``u`` ``[d_in]`` or ``[d_in, r]``, ``v`` ``[d_out]`` or ``[d_out, r]``.
        batch: JSON-able record of the many-fact edit the per-layer edits form (``"batch"`` in ``edit.json``).

    Returns:
        The directory.

    Raises:
        NonFiniteError: a factor holds NaN or inf (nothing is written).
    """
    folder = Path(path)
    tensors: dict[str, torch.Tensor] = {}
    for i, (u, v) in enumerate(factors):
        tensors[f"{i}.u"] = u.detach().cpu().contiguous()
        tensors[f"{i}.v"] = v.detach().cpu().contiguous()
    check_finite(tensors, "edit factors", "nothing was saved: recompute the edit")
    data = save_safetensors(tensors, metadata={"format": FORMAT})
    meta = {"format": FORMAT, "version": VERSION, "edits": list(records),
            **({"batch": batch} if batch is not None else {}), "tensors_sha256": sha256_hex(data)}
    atomic_write_bytes(folder / "edit.safetensors", data)
    atomic_write_text(folder / "edit.json", json.dumps(meta, indent=1, ensure_ascii=False) + "\n")
    return folder


def read_edit_files(path: str | os.PathLike[str]) -> tuple[list[dict[str, Any]], dict[str, Any], Path]:
    """The checked edit records of a folder written by :func:`write_edit_files`, its ``edit.json`` content and path.

    Returns:
        ``(records, meta, meta_path)``: each record holds ``node``, ``u``, ``v``, ``request``
        (:class:`~editors.requests.EditRequest` or ``None``), ``model_fingerprint`` and ``info``.

    Raises:
        EditLoadError: missing files; an unreadable, garbled or incomplete ``edit.json`` (a missing ``d_in``, say);
            another format or a newer version; an unreadable ``edit.safetensors`` or one from another save; a factor
            missing, non-finite or of another shape than ``[d_in]`` / ``[d_out]``. The message names the file.
    """
    folder = Path(path)
    meta_path, tensor_path = folder / "edit.json", folder / "edit.safetensors"
    if not meta_path.is_file() or not tensor_path.is_file():
        raise EditLoadError(f"{folder} has no edit.json/edit.safetensors; save edits with Edit.save or save_edits")
    meta = read_json(meta_path, EditLoadError, _LOAD_FIX)
    if meta.get("format") != FORMAT:
        raise EditLoadError(f"{meta_path} is not a gradpatch ROME edit (format {meta.get('format')!r})")
    if not isinstance(meta.get("version"), int) or meta["version"] > VERSION:
        raise EditLoadError(f"{meta_path} has version {meta.get('version')!r}; this gradpatch reads versions <= "
                            f"{VERSION}: upgrade gradpatch or {_LOAD_FIX}")
    records = meta.get("edits")
    if not isinstance(records, list):
        raise EditLoadError(f"{meta_path} has no 'edits' list; {_LOAD_FIX}")
    tensors = read_tensors(tensor_path, EditLoadError, _LOAD_FIX, meta.get("tensors_sha256"))
    checked = [_checked_record(i, record, tensors, meta_path, tensor_path) for i, record in enumerate(records)]
    return checked, meta, meta_path


def factor_shapes(d_in: int, d_out: int, dims: int, rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The shapes of ``(u, v)``: ``([d_in], [d_out])`` for vector factors, ``([d_in, r], [d_out, r])`` for matrices."""
    return ((d_in,), (d_out,)) if dims == 1 else ((d_in, rank), (d_out, rank))


def _checked_record(i: int, record: Any, tensors: dict[str, torch.Tensor], meta_path: Path,
                    tensor_path: Path) -> dict[str, Any]:
    """Edit ``i`` of a loaded file as the fields of an :class:`~editors.edits.edit.Edit`, every field and both factors
    checked.

    Raises:
        EditLoadError: naming the file and the field.
    """
    where = f"{meta_path}, edit {i}"
    if not isinstance(record, dict):
        raise EditLoadError(f"{where} is a {type(record).__name__}, not an object; {_LOAD_FIX}")
    missing = sorted({"node", "d_in", "d_out"} - set(record))
    if missing:
        raise EditLoadError(f"{where} lacks {missing}; {_LOAD_FIX}")
    node, sizes = record["node"], (record["d_in"], record["d_out"])
    if not isinstance(node, str) or "" in re.split(r"[.|]", node):
        raise EditLoadError(f"{where}: node {node!r} is not a NodePath of non-empty names; {_LOAD_FIX}")
    if not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in sizes):
        raise EditLoadError(f"{where}: d_in and d_out must be positive integers, got {sizes}; {_LOAD_FIX}")
    fingerprint, info = record.get("model_fingerprint"), record.get("info", {})
    if not (fingerprint is None or isinstance(fingerprint, str)) or not isinstance(info, dict):
        raise EditLoadError(f"{where}: model_fingerprint must be a string or null and info an object; {_LOAD_FIX}")
    factors = []
    rank = record.get("rank")
    if rank is not None and not (isinstance(rank, int) and not isinstance(rank, bool) and rank > 0):
        raise EditLoadError(f"{where}: rank must be a positive integer, got {rank!r}; {_LOAD_FIX}")
    shapes = factor_shapes(sizes[0], sizes[1], 1 if rank is None else 2, rank or 1)
    for name, shape in zip(("u", "v"), shapes):
        key = f"{i}.{name}"
        if key not in tensors:
            raise EditLoadError(f"{tensor_path} lacks tensor {key!r}; the files do not belong together: {_LOAD_FIX}")
        factor = tensors[key]
        if tuple(factor.shape) != shape:
            raise EditLoadError(f"{tensor_path}: {key!r} has shape {list(factor.shape)}, but edit.json says "
                                f"{list(shape)}; {_LOAD_FIX}")
        if not bool(torch.isfinite(factor).all()):
            raise EditLoadError(f"{tensor_path}: {key!r} holds NaN or inf; {_LOAD_FIX}")
        factors.append(factor)
    try:
        request = None if record.get("request") is None else EditRequest.from_dict(record["request"])
    except (ValueError, TypeError, AttributeError) as exc:
        raise EditLoadError(f"{where}: the request is invalid ({exc}); {_LOAD_FIX}") from exc
    return {"node": node, "u": factors[0], "v": factors[1], "request": request, "model_fingerprint": fingerprint,
            "info": info}
