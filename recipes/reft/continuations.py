"""Continuation and preference data for ReFT and BiPO: JSONL records and LightningDataModules.

Continuation files (ReFT's teacher-forced fine-tuning), one record per line::

    {"prompt": "Q: What is the capital of France?\\nA:", "response": " Paris."}

Preference files (BiPO's steering vectors; CAA's mean difference)::

    {"prompt": "Tell me about your day.", "chosen": " It was wonderful!", "rejected": " It was awful."}

A response (chosen, rejected) must be non-empty and chosen must differ from rejected; both are checked when the
file is read, before any training. The module tokenizes the records with its model's tokenizer.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import RecipeConfigError
from ..jsonl import JSONLDataModule, read_json_objects

__all__ = ["ContinuationDataModule", "ContinuationRecord", "PreferenceDataModule", "PreferenceRecord",
           "read_continuations", "read_preferences"]


@dataclass
class ContinuationRecord:
    """A prompt and the response the intervened model should continue it with (teacher forcing)."""

    prompt: str
    response: str


@dataclass
class PreferenceRecord:
    """A prompt, the continuation to make more likely (``chosen``) and the one to make less likely (``rejected``)."""

    prompt: str
    chosen: str
    rejected: str


def _read(path: str | Path, fields: tuple[str, ...], what: str) -> list[dict[str, str]]:
    """JSON objects of a JSONL file holding exactly ``fields``, each a non-empty string.

    Raises:
        RecipeConfigError: a missing or empty file, a line that is not a JSON object, a missing, empty or unknown
            field (each naming the line).
    """
    items = []
    for where, item in read_json_objects(path, what, str(list(fields))):
        missing = [key for key in fields if not isinstance(item.get(key), str) or not item[key].strip()]
        unknown = sorted(set(item) - set(fields))
        if missing or unknown:
            problem = f"missing or empty {missing}" if missing else f"unknown fields {unknown}"
            raise RecipeConfigError(f"{where}: {problem}; a {what} record holds exactly {list(fields)}, each a "
                                    f"non-empty string")
        items.append(item)
    return items


def read_continuations(path: str | Path) -> list[ContinuationRecord]:
    """Read ``{"prompt", "response"}`` JSONL records (blank lines skipped).

    Raises:
        RecipeConfigError: as :func:`_read` (an empty response among them).
    """
    return [ContinuationRecord(**item) for item in _read(path, ("prompt", "response"), "continuation")]


def read_preferences(path: str | Path) -> list[PreferenceRecord]:
    """Read ``{"prompt", "chosen", "rejected"}`` JSONL records (blank lines skipped).

    Raises:
        RecipeConfigError: as :func:`_read`, or a record whose chosen equals its rejected continuation (nothing to
            prefer).
    """
    records = [PreferenceRecord(**item) for item in _read(path, ("prompt", "chosen", "rejected"), "preference")]
    for number, record in enumerate(records, start=1):
        if record.chosen.strip() == record.rejected.strip():
            raise RecipeConfigError(f"{path}: record {number} ({record.prompt!r}) has chosen equal to rejected "
                                    f"({record.chosen!r}); give two different continuations")
    return records


class ContinuationDataModule(JSONLDataModule):
    """Batches of :class:`ContinuationRecord` (``{"prompt", "response"}`` JSONL) for ReFT's continuation NLL.

    Args:
        train_file: JSONL training records.
        eval_file: JSONL records whose NLL is the validation metric ``val_nll`` (``None``: no validation).
        batch_size, eval_batch_size: records per batch.
        shuffle: shuffle the training records every epoch (seeded by ``seed_everything``).

    Raises:
        RecipeConfigError: a batch size below 1; (in :meth:`setup`) unreadable files or empty responses.
    """

    def read(self, path: str) -> list[Any]:
        return read_continuations(path)


class PreferenceDataModule(JSONLDataModule):
    """Batches of :class:`PreferenceRecord` (``{"prompt", "chosen", "rejected"}`` JSONL) for BiPO.

    Args:
        as :class:`ContinuationDataModule` (the validation metric is ``val_preference_accuracy``).

    Raises:
        RecipeConfigError: a batch size below 1; (in :meth:`setup`) unreadable files, empty continuations, chosen
            equal to rejected.
    """

    def read(self, path: str) -> list[Any]:
        return read_preferences(path)
