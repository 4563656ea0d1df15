"""Files on disk: atomic writes, and checked reads of the JSON + safetensors pairs that hold interventions and edits.

A write goes to a temporary file in the destination folder, is flushed to disk and then renamed over the
destination (``os.replace``), so a reader sees the old file or the complete new one, never half of one. A pair of
files is written tensors first, JSON last, with the JSON recording the SHA-256 of the tensors file: a crash between
the two renames leaves a pair whose digests disagree, which :func:`read_tensors` reports.
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors

__all__ = ["atomic_write_bytes", "atomic_write_text", "read_json", "read_tensors", "read_yaml", "sha256_hex"]


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically (temporary file in the same folder, fsync, ``os.replace``).

    The folder is created if missing. On any failure the temporary file is removed and ``path`` is untouched.

    Returns:
        ``path`` as a ``Path``.

    Raises:
        OSError: the folder cannot be created or written.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(temporary, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    return path


def atomic_write_text(path: str | os.PathLike[str], text: str) -> Path:
    """:func:`atomic_write_bytes` of ``text`` encoded as UTF-8."""
    return atomic_write_bytes(path, text.encode("utf-8"))


def sha256_hex(data: bytes) -> str:
    """SHA-256 of ``data`` as 64 hex digits (recorded in a JSON file for the tensors file it goes with)."""
    return hashlib.sha256(data).hexdigest()


def read_json(path: Path, error: type[Exception], fix: str) -> dict[str, Any]:
    """Parse a file holding one JSON object.

    Args:
        path: the file.
        error: the exception type to raise (the caller's own, e.g. ``InterventionLoadError``).
        fix: what the user should do, appended to every message (e.g. ``"save the intervention again"``).

    Raises:
        error: the file is missing, unreadable, not UTF-8 JSON, or not a JSON object; the message names ``path``.
    """
    return _read_object(path, error, fix, "JSON", json.loads, json.JSONDecodeError)


def read_yaml(path: Path, error: type[Exception], fix: str) -> dict[str, Any]:
    """Parse a file holding one YAML mapping (as :func:`read_json`, for YAML: a config file of another library).

    Raises:
        error: the file is missing, unreadable, not UTF-8 YAML, or not a mapping; the message names ``path``.
    """
    import yaml

    return _read_object(path, error, fix, "YAML", yaml.safe_load, yaml.YAMLError)


def _read_object(path: Path, error: type[Exception], fix: str, kind: str, parse: Callable[[str], Any],
                 syntax_error: type[Exception]) -> dict[str, Any]:
    """The mapping that ``parse`` reads from the UTF-8 text of ``path``; ``error`` naming ``path``, ``kind`` and
    ``fix`` when the file is missing, unreadable, not ``kind`` or holds something else than a mapping."""
    if not path.is_file():
        raise error(f"{path} does not exist; {fix}")
    try:
        document = parse(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, syntax_error) as exc:
        raise error(f"{path} is unreadable or not {kind} ({exc}); {fix}") from exc
    if not isinstance(document, dict):
        raise error(f"{path} holds a {kind} {type(document).__name__}, not an object; {fix}")
    return document


def read_tensors(path: Path, error: type[Exception], fix: str, sha256: str | None = None) -> dict[str, torch.Tensor]:
    """Read a safetensors file, checking it against the SHA-256 its JSON file recorded.

    Args:
        path: the ``.safetensors`` file.
        error: the exception type to raise.
        fix: what the user should do, appended to every message.
        sha256: the digest recorded when the pair was saved (``None``: files from before digests, not checked).

    Returns:
        name -> tensor (on the CPU).

    Raises:
        error: the file is missing, unreadable or garbled, or its digest differs from ``sha256`` (the pair comes
            from two different saves, or the tensors file was damaged).
    """
    if not path.is_file():
        raise error(f"{path} does not exist; {fix}")
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise error(f"{path} is unreadable ({exc}); {fix}") from exc
    if sha256 is not None and sha256_hex(data) != sha256:
        raise error(f"{path} does not match the SHA-256 its JSON file recorded: the two files come from different "
                    f"saves or the tensors were damaged; {fix}")
    try:
        return load_safetensors(data)
    except SafetensorError as exc:
        raise error(f"{path} is not a readable safetensors file ({exc}); {fix}") from exc
