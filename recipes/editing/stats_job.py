"""Second-moment statistics as a distributed, resumable Lightning job: the corpus split over ranks, one reduce.

:func:`run_statistics_job` computes ``C = E[k kᵀ]`` at every node of a layer list (the MEMIT/AlphaEdit layers) in
one pass, as :func:`editors.layer_second_moments` does, but spread over the ranks of any Lightning strategy (``ddp``
on one or several nodes, started by Lightning's launcher, ``torchrun`` or SLURM):

1. The first ``n_samples`` documents are split by index (rank ``r`` of ``W`` reads documents ``r, r + W, ...``; no
   document twice, none padded in, unlike ``DistributedSampler``'s repeats), by length within blocks of 128.
2. Before any forward pass the ranks compare a digest of the nodes, model fingerprints, corpus and settings
   (one ``all_gather`` of a few integers) and all stop with :class:`StatisticsJobError` if they disagree.
3. Each rank adds ``Σ k kᵀ`` per node in float64 in place (:class:`editors.SecondMomentSums`: one ``[d_in, d_in]``
   accumulator per node plus one batch of activations) and writes its partial sums atomically every
   ``checkpoint_every`` documents (:mod:`recipes.editing.stats_partial`); a killed job started again resumes each rank
   after its last checkpoint, and gives the uninterrupted job's result.
4. At the end the counts are gathered, then each node's accumulator is all-reduced once (in place; ``d_in²``
   numbers per node, the only large collective), and rank 0 writes the cache files editors read
   (:func:`editors.save_second_moment` at :func:`editors.second_moment_cache_file`; same key, same format).

A batch with a non-finite key stops its rank's work; the ranks learn it at the gather of step 4 (no rank is
left waiting) and all raise :class:`gradpatch.errors.NonFiniteError` naming the rank and the document; nothing is
written but the checkpoints taken before that batch.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, Dataset, Sampler

from editors import DEFAULT_MAX_LENGTH, DEFAULT_N_SAMPLES, StatisticsError, resolve_layer
from editors.passes import start_token_tag
from editors.statistics import (Corpus, SecondMoment, SecondMomentSums, default_cache_dir, open_corpus,
                                save_second_moment, second_moment_cache_file, statistics_fingerprint)
from gradpatch.errors import NonFiniteError

from ..errors import StatisticsJobError
from .process_group import owned_process_group
from .stats_partial import JobIdentity, PartialSums, partial_file, read_partial, write_partial

__all__ = ["SecondMomentJob", "run_statistics_job", "shard_indices"]


#: Documents of a shard ordered by length together (fewer pads per batch); fixed, so a resumed job reads the same order.
LENGTH_BLOCK = 128


def shard_indices(texts: Sequence[str], rank: int, world_size: int) -> list[int]:
    """Documents of rank ``rank``, the order it reads them in: ``rank, rank + world_size, ...`` (every document read
    by one rank, once), sorted by character length within blocks of :data:`LENGTH_BLOCK`."""
    indices = list(range(rank, len(texts), world_size))
    blocks = (indices[i : i + LENGTH_BLOCK] for i in range(0, len(indices), LENGTH_BLOCK))
    return [index for block in blocks for index in sorted(block, key=lambda j: len(texts[j]))]


class _Tokenized(Dataset):
    """Document ``i`` as a list of token ids (truncated to ``max_length``; may be empty)."""

    def __init__(self, texts: Sequence[str], tokenizer: Any, max_length: int) -> None:
        self.texts, self.tokenizer, self.max_length = texts, tokenizer, max_length

    def __len__(self) -> int:
        return len(self.texts)

    def __getitem__(self, index: int) -> list[int]:
        return list(self.tokenizer(self.texts[index], truncation=True, max_length=self.max_length)["input_ids"])


class _ShardSampler(Sampler[int]):
    """This rank's document indices, from the ``start``-th on (resume)."""

    def __init__(self, indices: list[int], start: int) -> None:
        self.indices = indices[start:]

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


def _digest63(text: str) -> int:
    """First 63 bits of the SHA-256 of ``text`` (fits an int64 tensor for the agreement check)."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") >> 1


class SecondMomentJob(LightningModule):
    """The statistics pass as a Lightning prediction loop (``Trainer.predict``); see the module docstring.

    Args:
        pg: the model's :class:`gradpatch.PatchableGraph` (frozen; Lightning moves it to each rank's device).
        tokenizer: its tokenizer.
        nodes: NodePaths of the linear layers, e.g. ``model.layers_4.mlp.down_proj`` (their inputs are accumulated).
        corpus: ``None`` (Wikipedia summaries), a file path or a named :class:`editors.Corpus`.
        n_samples: documents to read (fewer if the corpus is shorter).
        max_length: truncation length in tokens.
        batch_size: documents per forward pass on each rank.
        cache_dir: where the cache files go (default :func:`editors.default_cache_dir`).
        partial_dir: where the per-rank checkpoints go (default ``cache_dir/partial``).
        checkpoint_every: documents of a rank's shard between two checkpoints (> 0).
        restart: discard existing checkpoints instead of resuming from them.

    Raises:
        StatisticsJobError: an anonymous corpus (it has no cache name), ``n_samples``/``max_length``/``batch_size``/
            ``checkpoint_every`` below 1, or no node.
        KeyError, LayerKindError: a NodePath that is not a linear layer of the graph.
    """

    def __init__(self, pg: nn.Module, tokenizer: Any, nodes: Sequence[str], corpus: Corpus | str | None = None,
                 n_samples: int = DEFAULT_N_SAMPLES, max_length: int = DEFAULT_MAX_LENGTH, batch_size: int = 16,
                 cache_dir: str | os.PathLike[str] | None = None, partial_dir: str | os.PathLike[str] | None = None,
                 checkpoint_every: int = 1000, restart: bool = False) -> None:
        super().__init__()
        for name, value in (("n_samples", n_samples), ("max_length", max_length), ("batch_size", batch_size),
                            ("checkpoint_every", checkpoint_every)):
            if not isinstance(value, int) or value < 1:
                raise StatisticsJobError(f"{name} must be a positive integer, got {value!r}")
        if not nodes:
            raise StatisticsJobError("no node given; pass the NodePaths of the layers, e.g. "
                                     "model.layers_4.mlp.down_proj")
        source = open_corpus(corpus)
        if source.name is None:
            raise StatisticsJobError("the corpus has no name, so its statistics cannot be cached; pass a file or "
                                     "Corpus(name=..., texts=...)")
        pg.requires_grad_(False)
        pg.train(False)
        self.pg, self.tokenizer = pg, tokenizer
        self.layers = [resolve_layer(pg, node) for node in nodes]
        self.texts = list(itertools.islice(iter(source), n_samples))
        corpus_sha = hashlib.sha256("\0".join(self.texts).encode()).hexdigest()
        self.identity_fields = dict(
            nodes=tuple(layer.input_node for layer in self.layers),
            fingerprints=tuple(statistics_fingerprint(pg, skip=(layer.path,)) for layer in self.layers),
            corpus=source.name, corpus_sha256=corpus_sha, n_samples=n_samples, max_length=max_length)
        self.batch_size, self.checkpoint_every, self.restart = batch_size, checkpoint_every, restart
        self.cache_dir = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
        self.partial_dir = Path(partial_dir).expanduser() if partial_dir is not None else self.cache_dir / "partial"
        self.results: list[SecondMoment] = []
        self.cache_files: list[Path] = []

    # --- before any work: agreement and resume ---------------------------------------------------------------

    def setup(self, stage: str) -> None:
        """Check that every rank runs the same job, then read this rank's checkpoint (resume).

        Raises:
            StatisticsJobError: ranks disagree (names the field and the ranks), or a rank's checkpoint comes from
                another configuration (every rank raises; that rank names the reason).
        """
        rank, world = self.trainer.global_rank, self.trainer.world_size
        self.identity = JobIdentity(**self.identity_fields, world_size=world)
        self.shard = shard_indices(self.texts, rank, world)
        self.checkpoint_path = partial_file(self.partial_dir, rank)
        refused: StatisticsJobError | None = None
        self.partial: PartialSums | None = None
        if self.restart:
            self.checkpoint_path.unlink(missing_ok=True)
        else:
            try:
                self.partial = read_partial(self.checkpoint_path, self.identity, rank,
                                            [layer.d_in for layer in self.layers], len(self.shard))
            except StatisticsJobError as error:
                refused = error
        fields = {key: value for key, value in asdict(self.identity).items() if key != "world_size"}
        codes = [_digest63(repr(value)) for value in fields.values()] + [int(refused is not None)]
        gathered = self.trainer.strategy.all_gather(torch.tensor(codes, dtype=torch.int64,
                                                                 device=self.trainer.strategy.root_device))
        table = gathered.reshape(world, len(codes)).cpu()
        for column, key in enumerate(fields):
            odd = [r for r in range(world) if table[r, column] != table[0, column]]
            if odd:
                raise StatisticsJobError(
                    f"ranks {odd} disagree with rank 0 on {key} (this is rank {rank}, {key}={fields[key]!r}); every "
                    f"rank must load the same model and corpus and get the same --nodes, --docs and --max-length")
        if refused is not None:
            raise refused
        refusing = [r for r in range(world) if table[r, -1]]
        if refusing:
            raise StatisticsJobError(f"ranks {refusing} refused their resume files (see their errors); nothing was "
                                     f"computed")

    def predict_dataloader(self) -> DataLoader:
        """This rank's shard from its checkpoint on, ``batch_size`` documents (token id lists) per batch."""
        start = self.partial.documents_done if self.partial is not None else 0
        return DataLoader(_Tokenized(self.texts, self.tokenizer, self.identity.max_length),
                          sampler=_ShardSampler(self.shard, start), batch_size=self.batch_size, collate_fn=list)

    # --- the pass -----------------------------------------------------------------------------------------

    def on_predict_start(self) -> None:
        """Create the float64 accumulators on the layers' devices, filled from the checkpoint when resuming."""
        self.sums = SecondMomentSums(self.pg, self.tokenizer, self.layers, torch.float64)
        self.done, self.saved_at, self.bad_document = 0, 0, -1
        self.results, self.cache_files = [], []
        if self.partial is not None:
            for total, saved in zip(self.sums.totals, self.partial.sums):
                total.copy_(saved)
            self.sums.n_tokens = self.partial.n_tokens
            self.done = self.saved_at = self.partial.documents_done

    def predict_step(self, batch: list[list[int]], batch_idx: int) -> None:
        """Add one batch's ``k kᵀ``; checkpoint every ``checkpoint_every`` documents; stop at a non-finite key."""
        if self.bad_document >= 0:
            return
        docs = [ids for ids in batch if ids]
        if docs and not self.sums.add(docs):
            self.bad_document = self.shard[self.done]  # the sums are spoilt: no checkpoint from here on
            return
        self.done += len(batch)
        if self.done - self.saved_at >= self.checkpoint_every:
            self._checkpoint()

    def _checkpoint(self) -> None:
        write_partial(self.checkpoint_path, self.identity, self.trainer.global_rank,
                      PartialSums(sums=self.sums.totals, n_tokens=self.sums.n_tokens, documents_done=self.done))
        self.saved_at = self.done

    def on_predict_end(self) -> None:
        """Gather the counts, all-reduce each node's sums once, and let rank 0 write the cache files.

        Raises:
            NonFiniteError: a rank met a non-finite sum (every rank raises; nothing is written).
            StatisticsError: the corpus gave no token.
        """
        strategy, world = self.trainer.strategy, self.trainer.world_size
        counts = torch.tensor([self.sums.n_tokens, self.done, self.bad_document], dtype=torch.int64,
                              device=strategy.root_device)
        table = strategy.all_gather(counts).reshape(world, 3).cpu()
        bad = [(r, int(table[r, 2])) for r in range(world) if table[r, 2] >= 0]
        if bad:
            raise NonFiniteError(
                f"layer inputs (keys) were non-finite (rank, corpus document): {bad}; every rank stopped and no cache "
                f"file was written (checkpoints before it are kept): check the model in that dtype on that document")
        if self.done != self.saved_at:
            self._checkpoint()  # a reduce that dies leaves every rank's sums on disk
        n_tokens, n_docs = int(table[:, 0].sum()), int(table[:, 1].sum())
        if n_tokens == 0:
            raise StatisticsError("The corpus gave no token; pass a corpus with text (a file, or a list of strings)")
        fields = self.identity
        for layer, fingerprint, total in zip(self.layers, fields.fingerprints, self.sums.totals):
            strategy.reduce(total, reduce_op="sum")  # in place: d_in² float64 numbers per node, once
            moment = SecondMoment(matrix=total.div_(n_tokens).cpu(), n_tokens=n_tokens, n_samples=n_docs,
                                  input_node=layer.input_node, fingerprint=fingerprint, corpus=fields.corpus)
            path = second_moment_cache_file(self.cache_dir, fingerprint, layer.input_node, fields.corpus,
                                            fields.n_samples, fields.max_length, torch.float64,
                                            start=start_token_tag(self.tokenizer))
            if self.trainer.global_rank == 0:
                save_second_moment(path, moment, fields.n_samples, fields.max_length, torch.float64)
            self.results.append(moment)
            self.cache_files.append(path)
        strategy.barrier("second-moment cache written")
        self.checkpoint_path.unlink(missing_ok=True)


def run_statistics_job(job: SecondMomentJob, **trainer_kwargs: Any) -> list[SecondMoment]:
    """Run ``job`` with ``Trainer(**trainer_kwargs)`` (no logger, checkpoints, model summary, nor sampler
    replacement: the job shards the corpus itself), on every rank.

    Args:
        job: the :class:`SecondMomentJob`.
        trainer_kwargs: e.g. ``accelerator="gpu", devices=8, strategy="ddp", num_nodes=2``, ``callbacks=[...]``.

    Returns:
        One :class:`editors.SecondMoment` per node (``matrix`` ``[d_in, d_in]`` float64 on the CPU), the same on
        every rank; rank 0 has written them to ``job.cache_files``.

    Raises:
        StatisticsJobError: ``use_distributed_sampler=True`` asked for, ranks that disagree, or a refused resume file.
        NonFiniteError: a non-finite sum on any rank.
    """
    if trainer_kwargs.pop("use_distributed_sampler", False):
        raise StatisticsJobError("use_distributed_sampler=True would repeat documents (DistributedSampler pads the "
                                 "shards); leave it out: the job shards the corpus itself")
    options = {"logger": False, "enable_checkpointing": False, "enable_model_summary": False, **trainer_kwargs}
    trainer = Trainer(use_distributed_sampler=False, **options)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="predict returned None")  # on purpose: the job returns its sums
        # Every rank ends after the same barrier or raises at the same point; leave no process group behind for gloo to
        # abort the process at exit.
        with owned_process_group():
            trainer.predict(job, return_predictions=False)
    return [SecondMoment(matrix=m.matrix.detach().cpu().clone(), n_tokens=m.n_tokens, n_samples=m.n_samples,
                         input_node=m.input_node, fingerprint=m.fingerprint, corpus=m.corpus) for m in job.results]
