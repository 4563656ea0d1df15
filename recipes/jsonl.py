"""JSON Lines files of training records (one JSON object per line, blank lines skipped, every error naming its line)
and the Lightning data module that batches them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader

from .errors import RecipeConfigError

__all__ = ["JSONLDataModule", "read_json_objects"]


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


def _as_list(batch: list[Any]) -> list[Any]:
    return batch


class JSONLDataModule(LightningDataModule):
    """Batches (lists) of records read from a JSONL train file and an optional eval file; a subclass says how a
    file is read (:meth:`read`).

    Raises:
        RecipeConfigError: ``batch_size`` or ``eval_batch_size`` below 1; (in :meth:`setup`) what :meth:`read` raises.
    """

    def __init__(self, train_file: str, eval_file: str | None = None, batch_size: int = 8,
                 eval_batch_size: int = 32, shuffle: bool = True) -> None:
        super().__init__()
        if batch_size < 1 or eval_batch_size < 1:
            raise RecipeConfigError(f"batch_size and eval_batch_size must be >= 1, got {batch_size}, "
                                    f"{eval_batch_size}")
        self.train_file, self.eval_file = train_file, eval_file
        self.batch_size, self.eval_batch_size, self.shuffle = batch_size, eval_batch_size, shuffle
        self.train_records: list[Any] = []
        self.eval_records: list[Any] = []

    def read(self, path: str) -> list[Any]:
        """The records of one file."""
        raise NotImplementedError(f"{type(self).__name__} must define read(path)")

    def setup(self, stage: str | None = None) -> None:
        """Read the files (once)."""
        if not self.train_records:
            self.train_records = self.read(self.train_file)
        if self.eval_file and not self.eval_records:
            self.eval_records = self.read(self.eval_file)

    def train_dataloader(self) -> DataLoader:
        records: Any = self.train_records
        return DataLoader(records, batch_size=self.batch_size, shuffle=self.shuffle, collate_fn=_as_list)

    def val_dataloader(self) -> DataLoader | list[Any]:
        if not self.eval_records:
            return []
        records: Any = self.eval_records
        return DataLoader(records, batch_size=self.eval_batch_size, collate_fn=_as_list)
