"""CounterFact-format edit requests and evaluation cases (Meng et al. 2022, section 4.2).

A case is the JSON record::

    {"case_id": 0,
     "requested_rewrite": {"prompt": "The capital of {} is", "subject": "France",
                           "target_new": {"str": "London"}, "target_true": {"str": "Paris"},
                           "relation_id": "P36"},
     "paraphrase_prompts": ["France's capital city is", ...],
     "neighborhood_prompts": ["The Eiffel Tower is located in the city of", ...]}

Targets are stored without a leading space and scored as ``prompt + " " + target``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .tokens import format_with_span

__all__ = ["CounterFactCase", "EditRequest", "load_cases", "save_cases"]


@dataclass(frozen=True)
class EditRequest:
    """One fact to rewrite: ``prompt.format(subject)`` should continue with ``target_new``.

    Attributes:
        prompt: template with one ``"{}"`` for the subject, e.g. ``"The capital of {} is"``.
        subject: the entity, e.g. ``"France"``.
        target_new: the new object without leading space, e.g. ``"London"``.
        target_true: the current object (used for evaluation only; may be empty).
        relation_id: optional Wikidata relation id such as ``"P36"``.
    """

    prompt: str
    subject: str
    target_new: str
    target_true: str = ""
    relation_id: str = ""

    def __post_init__(self) -> None:
        format_with_span(self.prompt, self.subject)  # validates the "{}" placeholder and the subject
        if not self.target_new.strip():
            raise ValueError("target_new is empty: give the new object, e.g. 'London'")
        if self.target_new != self.target_new.strip():
            raise ValueError(f"target_new {self.target_new!r} has surrounding spaces: store it as {self.target_new.strip()!r}")

    @property
    def text(self) -> str:
        """The filled prompt, e.g. ``"The capital of France is"``."""
        return self.prompt.format(self.subject)

    @classmethod
    def from_dict(cls, record: Mapping[str, Any]) -> "EditRequest":
        """Build from a CounterFact ``requested_rewrite`` dict (``target_*`` as ``{"str": ...}`` or plain strings)."""

        def _str(value: Any) -> str:
            return value["str"] if isinstance(value, Mapping) else str(value or "")

        try:
            return cls(
                prompt=record["prompt"],
                subject=record["subject"],
                target_new=_str(record["target_new"]).strip(),
                target_true=_str(record.get("target_true", "")).strip(),
                relation_id=str(record.get("relation_id", "")),
            )
        except KeyError as exc:
            raise ValueError(f"requested_rewrite lacks {exc}: it needs prompt, subject and target_new") from None

    def to_dict(self) -> dict[str, Any]:
        """The CounterFact ``requested_rewrite`` dict."""
        return {
            "prompt": self.prompt,
            "relation_id": self.relation_id,
            "subject": self.subject,
            "target_new": {"str": self.target_new},
            "target_true": {"str": self.target_true},
        }


@dataclass(frozen=True)
class CounterFactCase:
    """One evaluation case: the rewrite plus prompts that test generalisation and specificity.

    Attributes:
        case_id: identifier carried into per-case rows.
        request: the rewrite.
        paraphrase_prompts: other phrasings of the rewritten fact (should now prefer ``target_new``).
        neighborhood_prompts: prompts about other subjects whose answer is ``target_true`` (should keep it).
    """

    case_id: int | str
    request: EditRequest
    paraphrase_prompts: tuple[str, ...] = field(default_factory=tuple)
    neighborhood_prompts: tuple[str, ...] = field(default_factory=tuple)

    @classmethod
    def from_dict(cls, record: Mapping[str, Any]) -> "CounterFactCase":
        """Build from one CounterFact JSON record."""
        if "requested_rewrite" not in record:
            raise ValueError(f"Case {record.get('case_id', '?')} has no 'requested_rewrite': see editors.counterfact docs")
        request = EditRequest.from_dict(record["requested_rewrite"])
        if not request.target_true:
            raise ValueError(f"Case {record.get('case_id', '?')}: evaluation needs requested_rewrite.target_true")
        return cls(
            case_id=record.get("case_id", 0),
            request=request,
            paraphrase_prompts=tuple(record.get("paraphrase_prompts", ())),
            neighborhood_prompts=tuple(record.get("neighborhood_prompts", ())),
        )

    def to_dict(self) -> dict[str, Any]:
        """The CounterFact JSON record."""
        return {
            "case_id": self.case_id,
            "requested_rewrite": self.request.to_dict(),
            "paraphrase_prompts": list(self.paraphrase_prompts),
            "neighborhood_prompts": list(self.neighborhood_prompts),
        }


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
