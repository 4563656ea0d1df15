"""Partial-sum checkpoints of the distributed statistics job (:mod:`recipes.editing.stats_job`): one file per rank.

A rank's file holds its float64 sums ``Σ k kᵀ`` (tensor ``sum_<i>`` ``[d_in, d_in]`` per node, in the job's node
order) after the first ``documents_done`` documents of its shard, the token count, and the job's
:class:`JobIdentity` as JSON metadata. It is written atomically (temporary file + rename,
:func:`gradpatch.files.atomic.atomic_write_bytes`), so a job killed while writing leaves the previous checkpoint whole.

Reading sorts a file into three cases: absent (start the shard), damaged (named in a :class:`PartialSumsWarning`,
start the shard again) or from another configuration (refused: :class:`StatisticsJobError` with the reason).
"""

from __future__ import annotations

import json
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save as save_safetensors

from gradpatch.files.atomic import atomic_write_bytes

from ..errors import PartialSumsWarning, StatisticsJobError

__all__ = ["FORMAT", "JobIdentity", "PartialSums", "partial_file", "read_partial", "write_partial"]

#: ``format`` metadata of a partial-sum file.
FORMAT = "gradpatch-second-moment-partial/1"


@dataclass(frozen=True)
class JobIdentity:
    """What makes two runs of the statistics job the same computation (every field must match to resume).

    Attributes:
        nodes: NodePaths of the layer inputs, in order.
        fingerprints: :func:`editors.statistics_fingerprint` per node (the edited layer left out).
        corpus: corpus name (the cache key's).
        corpus_sha256: SHA-256 of the documents read (the first ``n_samples``), so a changed file is noticed.
        n_samples: documents asked for.
        max_length: truncation length in tokens.
        world_size: number of ranks (the shards depend on it).
    """

    nodes: tuple[str, ...]
    fingerprints: tuple[str, ...]
    corpus: str
    corpus_sha256: str
    n_samples: int
    max_length: int
    world_size: int

    def differences(self, other: JobIdentity) -> list[str]:
        """Human-readable differences, ``"world_size: 2 in the file, 1 in this job"``, empty when equal."""
        mine, theirs = asdict(self), asdict(other)
        return [f"{key}: {theirs[key]} in the file, {mine[key]} in this job"
                for key in mine if mine[key] != theirs[key]]


@dataclass
class PartialSums:
    """One rank's progress.

    Attributes:
        sums: ``Σ k kᵀ`` ``[d_in, d_in]`` float64 per node.
        n_tokens: tokens in the sums.
        documents_done: documents of the rank's shard read so far (from its start).
    """

    sums: list[torch.Tensor]
    n_tokens: int
    documents_done: int


def partial_file(folder: Path, rank: int) -> Path:
    """``folder/rank<rank>.safetensors``."""
    return folder / f"rank{rank:05d}.safetensors"


def write_partial(path: Path, identity: JobIdentity, rank: int, partial: PartialSums) -> Path:
    """Write one rank's checkpoint atomically.

    Raises:
        OSError: the folder cannot be written.
    """
    tensors = {f"sum_{i}": total.detach().to(torch.float64).cpu().contiguous() for i, total in enumerate(partial.sums)}
    metadata = {"format": FORMAT, "identity": json.dumps(asdict(identity)), "rank": str(rank),
                "n_tokens": str(partial.n_tokens), "documents_done": str(partial.documents_done)}
    return atomic_write_bytes(path, save_safetensors(tensors, metadata=metadata))


def read_partial(path: Path, identity: JobIdentity, rank: int, dims: list[int], shard_size: int) -> PartialSums | None:
    """One rank's checkpoint, checked against this job.

    Args:
        path: the file (:func:`partial_file`).
        identity: this job's identity.
        rank: this rank.
        dims: ``d_in`` per node.
        shard_size: documents in this rank's shard.

    Returns:
        The partial sums, or ``None`` when there is no file or it is damaged (a :class:`PartialSumsWarning`
        names the file and the problem; the rank starts its shard again and overwrites it).

    Raises:
        StatisticsJobError: the file belongs to another configuration (the differences are listed; rerun with the
            same settings, or pass ``restart=True`` / ``--restart`` to discard it).
    """
    if not path.is_file():
        return None
    try:
        with safe_open(str(path), framework="pt") as handle:
            meta = handle.metadata() or {}
            sums = [handle.get_tensor(f"sum_{i}") for i in range(len(dims))]
        if meta.get("format") != FORMAT:
            return _damaged(path, f"has format {meta.get('format')!r}, not {FORMAT!r}")
        fields = json.loads(meta["identity"])
        theirs = JobIdentity(**{**fields, "nodes": tuple(fields["nodes"]),
                                "fingerprints": tuple(fields["fingerprints"])})
        file_rank, n_tokens, done = int(meta["rank"]), int(meta["n_tokens"]), int(meta["documents_done"])
    except (SafetensorError, OSError, KeyError, ValueError, TypeError) as error:
        return _damaged(path, f"is unreadable or incomplete ({type(error).__name__}: {error})")
    reasons = identity.differences(theirs)
    if file_rank != rank:
        reasons.append(f"rank: {file_rank} in the file, {rank} here")
    if reasons:
        raise StatisticsJobError(
            f"resume file {path} comes from another statistics job ({'; '.join(reasons)}); it is not mixed in: rerun "
            f"with the settings it was written with, or discard it with --restart (restart=True)")
    for total, dim in zip(sums, dims):
        if total.shape != (dim, dim) or total.dtype != torch.float64 or not bool(torch.isfinite(total).all()):
            return _damaged(path, f"holds a {total.dtype} sum of shape {list(total.shape)} or non-finite values, "
                                  f"not float64 [{dim}, {dim}]")
    if not 0 <= done <= shard_size or n_tokens < 0:
        return _damaged(path, f"records {done} documents and {n_tokens} tokens for a shard of {shard_size}")
    return PartialSums(sums=sums, n_tokens=n_tokens, documents_done=done)


def _damaged(path: Path, problem: str) -> None:
    warnings.warn(f"partial-sum checkpoint {path} {problem}; this rank starts its shard again and replaces the file",
                  PartialSumsWarning, stacklevel=3)
    return None
