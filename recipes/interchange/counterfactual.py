"""Counterfactual data for interchange intervention training: JSONL records and a LightningDataModule.

Each line of a file is one record::

    {"base": "Paris is a city in the country of", "source": "Tokyo is a city in the country of", "label": " Japan",
     "base_subject": "Paris", "source_subject": "Tokyo"}

``label`` is one token: the answer the causal model predicts after the swap. Optional ``base_position`` and
``source_position`` (an index, negative from the end) or ``base_subject`` and ``source_subject`` (the last token of
that subject) say where to intervene; without them the module's default position applies (``"last"`` unless
configured otherwise; ``null`` interchanges every position, which needs base and source of the same token length,
checked by :class:`~recipes.interchange.module.InterventionModule` before training).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..errors import RecipeConfigError
from ..jsonl import JSONLDataModule, read_json_objects

__all__ = ["CounterfactualDataModule", "CounterfactualRecord", "read_counterfactuals"]

_REQUIRED = ("base", "source", "label")
_OPTIONAL = {"base_position": int, "source_position": int, "base_subject": str, "source_subject": str}


@dataclass
class CounterfactualRecord:
    """One base/source pair and the label the causal model predicts after the interchange.

    Attributes:
        base, source: the prompts.
        label: one token (e.g. ``" Japan"``).
        base_position, source_position: token index to intervene at (negative counts from the end), or ``None``.
        base_subject, source_subject: intervene at the last token of this subject (overrides the position).
    """

    base: str
    source: str
    label: str
    base_position: int | None = None
    source_position: int | None = None
    base_subject: str | None = None
    source_subject: str | None = None


def read_counterfactuals(path: str | Path) -> list[CounterfactualRecord]:
    """Read a JSONL file of counterfactual records (blank lines skipped).

    Raises:
        RecipeConfigError: a missing or empty file, a line that is not a JSON object, a record without ``base``,
            ``source`` or ``label``, a field of the wrong type, an unknown field (each naming the line).
    """
    records = []
    for where, item in read_json_objects(path, "counterfactual", "base, source, label"):
        missing = [key for key in _REQUIRED if not isinstance(item.get(key), str) or not item[key]]
        unknown = sorted(set(item) - set(_REQUIRED) - set(_OPTIONAL))
        if missing or unknown:
            raise RecipeConfigError(f"{where}: {'missing/empty ' + str(missing) if missing else ''}"
                                    f"{' unknown fields ' + str(unknown) if unknown else ''}; records hold "
                                    f"{list(_REQUIRED)} and optionally {list(_OPTIONAL)}")
        for key, kind in _OPTIONAL.items():
            if item.get(key) is not None and (not isinstance(item[key], kind) or isinstance(item[key], bool)):
                raise RecipeConfigError(f"{where}: {key} must be {kind.__name__}, got {item[key]!r}")
        records.append(CounterfactualRecord(**item))
    return records


class CounterfactualDataModule(JSONLDataModule):
    """Batches of :class:`CounterfactualRecord` (lists: the module tokenizes them with its model's tokenizer).

    Args:
        train_file: JSONL training records.
        eval_file: JSONL records whose IIA is the validation metric (``None``: no validation).
        batch_size: records per training batch (each makes a base and a source row).
        eval_batch_size: records per validation batch.
        shuffle: shuffle the training records every epoch (seeded by the trainer's ``seed_everything``).

    Raises:
        RecipeConfigError: ``batch_size`` below 1; (in :meth:`setup`) unreadable files.
    """

    def __init__(self, train_file: str, eval_file: str | None = None, batch_size: int = 16,
                 eval_batch_size: int = 64, shuffle: bool = True) -> None:
        super().__init__(train_file, eval_file, batch_size, eval_batch_size, shuffle)

    def read(self, path: str) -> list[CounterfactualRecord]:
        return read_counterfactuals(path)
