"""JSON Lines files of training records: one JSON object per line, blank lines skipped, every error naming its line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .errors import RecipeConfigError

__all__ = ["read_json_objects"]


def read_json_objects(path: str | Path, what: str, shape: str) -> list[tuple[str, dict[str, Any]]]:
    """The JSON objects of a JSONL file, each with where it stands (``"FILE:LINE"``) for the caller's field checks.

    Args:
        path: the JSONL file.
        what: the kind of record, for messages (``"counterfactual"``).
        shape: what a record holds, for messages (``"base, source, label"``).

    Raises:
        RecipeConfigError: a missing file, a line that is not JSON or not a JSON object (naming the line), a file
            with no records.
    """
    path = Path(path)
    if not path.is_file():
        raise RecipeConfigError(f"{what} file {path} does not exist; give --data.train_file/--data.eval_file")
    objects = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            item = json.loads(line)
        except json.JSONDecodeError as error:
            raise RecipeConfigError(f"{where}: not JSON ({error}); one record per line") from error
        if not isinstance(item, dict):
            raise RecipeConfigError(f"{where}: a record is a JSON object with {shape}")
        objects.append((where, item))
    if not objects:
        raise RecipeConfigError(f"{path} holds no records")
    return objects
