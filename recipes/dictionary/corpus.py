"""The text a dictionary is trained and evaluated on: documents from a file or the offline Wikipedia summaries, as
token ids.

- :func:`read_documents`: a ``.txt`` file is one document per line, a ``.jsonl`` file one per line in its ``text``
  field; without a file, the English Wikipedia summaries the second-moment statistics read
  (:func:`editors.statistics.wiki_summaries`, fixed order).
- :func:`tokenize_documents`: each document tokenized as the tokenizer does by default (its special tokens
  included), truncated to ``max_length``, until a token budget is reached; what ``gradpatch dictionary eval`` scores,
  one document per forward pass.
- :func:`packed_chunks`: those documents concatenated and cut into chunks ``[n, length]`` without padding, what a
  dictionary trains on (as SAELens and sparsify do).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from ..errors import RecipeConfigError

__all__ = ["packed_chunks", "read_documents", "tokenize_documents"]


def read_documents(path: str | Path | None = None) -> list[str]:
    """The documents of a corpus, empty ones left out.

    Args:
        path: a ``.txt`` file (one document per line) or ``.jsonl`` file (one JSON object per line, its ``text``
            field); ``None`` for the offline English Wikipedia summaries.

    Returns:
        The documents, in file order (the summaries in their fixed shuffled order).

    Raises:
        FileNotFoundError: ``path`` does not exist, or the summaries' package is not installed.
        RecipeConfigError: another suffix, or a JSONL line that is not an object with a string ``text``.
    """
    if path is None:
        from editors.statistics import wiki_summaries

        return list(wiki_summaries())
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"corpus file not found: {path} (give a .txt or .jsonl file)")
    suffix = path.suffix.lower()
    if suffix not in (".txt", ".jsonl"):
        raise RecipeConfigError(f"corpus {path}: a .txt file (one document per line) or a .jsonl file (its 'text' "
                                f"field) is needed, not {suffix or 'a file without suffix'}")
    lines = path.read_text(encoding="utf-8").splitlines()
    if suffix == ".txt":
        return [line for line in lines if line.strip()]
    documents = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise RecipeConfigError(f"corpus {path}, line {number}: not JSON ({error.msg})") from error
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise RecipeConfigError(f"corpus {path}, line {number}: each line must be an object with a string "
                                    f"'text' field")
        if record["text"].strip():
            documents.append(record["text"])
    return documents


def tokenize_documents(tokenizer: Any, documents: list[str], tokens: int,
                       max_length: int) -> tuple[list[list[int]], int]:
    """Token ids of the first documents, each truncated to ``max_length``, until ``tokens`` are reached (the last
    document cut to land on ``tokens`` exactly; fewer when the corpus is shorter).

    Args:
        tokenizer: a Hugging Face tokenizer, called with its defaults (special tokens added as it adds them).
        documents: the texts.
        tokens: the token budget (≥ 2).
        max_length: tokens per document at most (≥ 2, so that each has a next-token prediction).

    Returns:
        One list of ids per document kept (documents of fewer than 2 tokens are skipped), and how many documents were
        read (``documents[read:]`` are left for another use, e.g. held-out evaluation).

    Raises:
        RecipeConfigError: ``tokens`` < 1 or ``max_length`` < 2.
    """
    if tokens < 2 or max_length < 2:
        raise RecipeConfigError(f"a token budget >= 2 and a max length >= 2 are needed, got {tokens} and {max_length}")
    out: list[list[int]] = []
    left, read = tokens, 0
    for text in documents:
        if left < 2:
            break
        read += 1
        ids = list(tokenizer(text, truncation=True, max_length=max_length)["input_ids"])[:left]
        if len(ids) >= 2:
            out.append(ids)
            left -= len(ids)
    return out, read


def packed_chunks(tokenizer: Any, documents: list[str], count: int, length: int, max_length: int) -> torch.Tensor:
    """The documents tokenized (:func:`tokenize_documents`), concatenated and cut into ``count`` chunks.

    Args:
        tokenizer, documents, max_length: as :func:`tokenize_documents`.
        count: chunks wanted.
        length: tokens per chunk.

    Returns:
        Token ids ``[n, length]``, ``n ≤ count`` (fewer when the corpus is shorter).

    Raises:
        RecipeConfigError: ``count`` or ``length`` < 1, or the corpus gives less than one chunk.
    """
    if count < 1 or length < 1:
        raise RecipeConfigError(f"chunk count and length must be >= 1, got {count} and {length}")
    documents_ids, _ = tokenize_documents(tokenizer, documents, count * length, max_length)
    ids = [i for document in documents_ids for i in document]
    n = len(ids) // length
    if n == 0:
        raise RecipeConfigError(f"the corpus gives {len(ids)} tokens, fewer than one chunk of {length}")
    return torch.tensor(ids[:n * length]).reshape(n, length)
