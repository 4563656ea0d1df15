"""CounterFact-format evaluation cases (Meng et al. 2022, section 4.2); their rewrite is an
:class:`~editors.requests.EditRequest`.

A case is the JSON record::

    {"case_id": 0,
     "requested_rewrite": {"prompt": "The capital of {} is", "subject": "France",
                           "target_new": {"str": "London"}, "target_true": {"str": "Paris"},
                           "relation_id": "P36"},
     "paraphrase_prompts": ["France's capital city is", ...],
     "neighborhood_prompts": ["The Eiffel Tower is located in the city of", ...],
     "form_prompts": {"subject_first": "France's capital is", ...}}

``form_prompts`` (optional, not in CounterFact) holds the same rewrite in other prompt forms, named by form
(:mod:`editors.evaluation.forms`); each should now prefer ``target_new``, and the evaluation scores each form apart.
Targets are stored without a leading space and scored as ``prompt + " " + target``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..requests import EditRequest

__all__ = ["CounterFactCase", "load_cases", "save_cases"]


@dataclass(frozen=True)
class CounterFactCase:
    """One evaluation case: the rewrite plus prompts that test generalisation and specificity.

    Attributes:
        case_id: identifier carried into per-case rows.
        request: the rewrite.
        paraphrase_prompts: other phrasings of the rewritten fact (should now prefer ``target_new``).
        neighborhood_prompts: prompts about other subjects whose answer is ``target_true`` (should keep it).
        form_prompts: form name -> the rewrite prompt in that form, subject filled in (should now prefer
            ``target_new``; :mod:`editors.evaluation.forms`).
    """

    case_id: int | str
    request: EditRequest
    paraphrase_prompts: tuple[str, ...] = field(default_factory=tuple)
    neighborhood_prompts: tuple[str, ...] = field(default_factory=tuple)
    form_prompts: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, record: Mapping[str, Any]) -> "CounterFactCase":
        """Build from one CounterFact JSON record."""
        if "requested_rewrite" not in record:
            raise ValueError(f"Case {record.get('case_id', '?')} has no 'requested_rewrite': see editors.evaluation.counterfact docs")
        request = EditRequest.from_dict(record["requested_rewrite"])
        if not request.target_true:
            raise ValueError(f"Case {record.get('case_id', '?')}: evaluation needs requested_rewrite.target_true")
        forms = record.get("form_prompts", {})
        if not isinstance(forms, Mapping) or not all(isinstance(k, str) and isinstance(v, str) and v
                                                     for k, v in forms.items()):
            raise ValueError(f"Case {record.get('case_id', '?')}: form_prompts must map form names to prompts "
                             f"(strings with the subject filled in), got {forms!r}")
        return cls(
            case_id=record.get("case_id", 0),
            request=request,
            paraphrase_prompts=tuple(record.get("paraphrase_prompts", ())),
            neighborhood_prompts=tuple(record.get("neighborhood_prompts", ())),
            form_prompts=dict(forms),
        )

    def to_dict(self) -> dict[str, Any]:
        """The CounterFact JSON record."""
        record = {
            "case_id": self.case_id,
            "requested_rewrite": self.request.to_dict(),
            "paraphrase_prompts": list(self.paraphrase_prompts),
            "neighborhood_prompts": list(self.neighborhood_prompts),
        }
        return record | ({"form_prompts": dict(self.form_prompts)} if self.form_prompts else {})


def load_cases(source: str | os.PathLike[str] | Iterable[Mapping[str, Any]]) -> list[CounterFactCase]:
    """Read CounterFact cases from a JSON file (a list of records) or from records already in memory.

    Args:
        source: path to a ``.json`` file, or an iterable of record dicts.

    Returns:
        The cases, in file order.

    Raises:
        FileNotFoundError: the file does not exist.
        ValueError: the JSON is not a list of records, or a record is malformed (the message names the case and
            the record's index), e.g. a prompt without the ``"{}"`` the subject fills (SubjectNotFoundError).
    """
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        if not path.is_file():
            raise FileNotFoundError(f"Cases file not found: {path} (give a JSON list of CounterFact records)")
        records = json.loads(path.read_text(encoding="utf-8"))
        if isinstance(records, Mapping):
            records = [records]
    else:
        records = list(source)
    if not isinstance(records, Sequence) or not records:
        raise ValueError("Expected a non-empty JSON list of CounterFact records")
    cases = []
    for i, record in enumerate(records):
        try:
            cases.append(CounterFactCase.from_dict(record))
        except ValueError as exc:  # SubjectNotFoundError included: say which case to fix
            case_id = record.get("case_id", "?") if isinstance(record, Mapping) else "?"
            raise type(exc)(f"Case {case_id} (record {i}): {exc}") from None
    return cases


def save_cases(cases: Sequence[CounterFactCase], path: str | os.PathLike[str]) -> None:
    """Write cases as a JSON list of CounterFact records (UTF-8, indented)."""
    Path(path).write_text(json.dumps([c.to_dict() for c in cases], indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
