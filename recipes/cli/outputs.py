"""What the ``gradpatch`` commands write with ``--out``: refused when it holds an earlier run (unless ``--overwrite``),
then replaced whole, never mixed, and every file stamped with what produced it.

- :func:`add_output_options` adds ``--out`` and ``--overwrite``; :func:`earlier_run` is the refusal a command makes
  before it loads a model (exit status 2, the message naming ``--overwrite``).
- :func:`staged_folder` gives a new folder beside ``--out`` (``.<name>.<random>.partial``, made with the user's
  umask) for the command to write into; when the block ends without an error every top-level JSON object in it gets
  a ``"provenance"`` key, ``provenance.json`` lists every file with its SHA-256, and the folder takes the place of
  ``--out`` (the earlier run, if any, renamed aside and then removed). On an error the folder is removed and
  ``--out`` is left as it was: nothing half-written.
- :func:`write_json_output` does the same for a command whose ``--out`` is one JSON file (written atomically).

The provenance record (:func:`provenance`): ``command`` (the command line), ``arguments`` (every option as parsed,
defaults included: the prompt, the dictionaries, the model...), ``working_directory``, ``created`` (UTC) and
``versions`` of gradpatch, torch, transformers and Python.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path
from typing import Any

__all__ = ["PROVENANCE_KEY", "PROVENANCE_NAME", "add_output_options", "earlier_run",
           "provenance", "staged_folder", "write_json_output"]

#: The key every JSON object written by a command gets, and the file that lists a folder's files.
PROVENANCE_KEY = "provenance"
PROVENANCE_NAME = "provenance.json"
_PACKAGES = ("gradpatch", "torch", "transformers")


def add_output_options(p: argparse.ArgumentParser, help: str, *, default: str | None = None,
                       metavar: str = "DIR") -> None:
    """Add ``--out`` (required unless ``default`` is given) and ``--overwrite``."""
    p.add_argument("--out", required=default is None, default=default, metavar=metavar,
                   help=help + ("" if default is None else " (default: %(default)s)") +
                   "; refused when it holds an earlier run, unless --overwrite")
    p.add_argument("--overwrite", action="store_true",
                   help="replace what --out holds (an earlier run) whole; without it such an --out is refused")


def earlier_run(args: argparse.Namespace) -> str | None:
    """The usage error of an ``--out`` that holds an earlier run (a non-empty folder or a file) without
    ``--overwrite``, else ``None``."""
    out = Path(args.out)
    holds = out.is_symlink() or out.is_file() or (out.is_dir() and any(out.iterdir()))
    if not holds or args.overwrite:
        return None
    return (f"--out {out} holds an earlier run; give --overwrite to replace it whole (nothing of it is kept), or "
            f"another --out")


def provenance(args: argparse.Namespace) -> dict[str, Any]:
    """What produced a command's output (module docstring), from its parsed ``args`` (``args.command_line``: the
    arguments :func:`recipes.cli.main` was given)."""
    arguments = {key: value for key, value in sorted(vars(args).items())
                 if key not in ("func", "command_line") and _is_json(value)}
    return {"command": ["gradpatch", *getattr(args, "command_line", [])], "arguments": arguments,
            "working_directory": os.getcwd(),
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "versions": {name: _version(name) for name in _PACKAGES} | {"python": platform.python_version()}}


@contextmanager
def staged_folder(args: argparse.Namespace) -> Iterator[Path]:
    """A new, empty folder beside ``args.out`` to write the command's files into; on a clean exit the files are
    stamped (module docstring) and the folder replaces ``args.out`` whole.

    Raises:
        recipes.errors.OutputExistsError: ``args.out`` came to hold a run meanwhile and ``args.overwrite`` is not set
            (the staged folder is removed).
        OSError: the folder beside ``args.out`` cannot be made or renamed (``args.out`` is left as it was).
    """
    out = Path(args.out).absolute()
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.with_name(f".{out.name}.{uuid.uuid4().hex[:8]}.partial")
    staging.mkdir()  # not tempfile.mkdtemp: the folder keeps the user's umask, not 0700
    try:
        yield staging
        _stamp_folder(staging, provenance(args))
        problem = earlier_run(args)
        if problem:
            from ..errors import OutputExistsError  # imports gradpatch (torch): only when refusing

            raise OutputExistsError(problem)
        _replace(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def write_json_output(args: argparse.Namespace, record: dict[str, Any]) -> Path:
    """Write ``record`` with a ``"provenance"`` key to the file ``args.out`` atomically; returns its path.

    Raises:
        recipes.errors.OutputExistsError: the file exists and ``args.overwrite`` is not set.
        OSError: the file cannot be written.
    """
    from gradpatch.files.atomic import atomic_write_text

    problem = earlier_run(args)
    if problem:
        from ..errors import OutputExistsError  # imports gradpatch (torch): only when refusing

        raise OutputExistsError(problem)
    text = json.dumps(record | {PROVENANCE_KEY: provenance(args)}, indent=1, ensure_ascii=False) + "\n"
    return atomic_write_text(args.out, text)


def _stamp_folder(folder: Path, record: dict[str, Any]) -> None:
    """Add ``record`` to every top-level JSON object under ``folder`` and write ``provenance.json`` (the record and
    each file's SHA-256)."""
    from gradpatch.files.atomic import atomic_write_text, sha256_hex

    for path in sorted(folder.rglob("*.json")):
        document = json.loads(path.read_text(encoding="utf-8"))
        if isinstance(document, dict):
            atomic_write_text(path, json.dumps(document | {PROVENANCE_KEY: record}, indent=1, ensure_ascii=False))
    files = {path.relative_to(folder).as_posix(): sha256_hex(path.read_bytes())
             for path in sorted(folder.rglob("*")) if path.is_file()}
    atomic_write_text(folder / PROVENANCE_NAME, json.dumps(record | {"files": files}, indent=1, ensure_ascii=False))


def _replace(staging: Path, out: Path) -> None:
    """Put the folder ``staging`` at ``out``: what ``out`` held is renamed aside first, then removed."""
    if not (out.exists() or out.is_symlink()):
        os.replace(staging, out)
        return
    aside = out.with_name(f".{out.name}.{uuid.uuid4().hex[:8]}.replaced")
    os.replace(out, aside)
    try:
        os.replace(staging, out)
    except OSError:
        os.replace(aside, out)  # the earlier run back in its place
        raise
    if aside.is_dir() and not aside.is_symlink():
        shutil.rmtree(aside)
    else:
        aside.unlink()


def _is_json(value: Any) -> bool:
    return value is None or isinstance(value, (str, int, float, bool)) or (
        isinstance(value, (list, tuple)) and all(_is_json(item) for item in value))


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None
