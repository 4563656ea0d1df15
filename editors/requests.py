"""An edit request: one fact to rewrite (Meng et al. 2022, section 4.2: a CounterFact ``requested_rewrite``).

Edits (:mod:`editors.edits`), the value search (:mod:`editors.value`) and the evaluation (:mod:`editors.evaluation`)
all take requests; this module is their one shared definition.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .passes.tokens import format_with_span

__all__ = ["EditRequest"]


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
