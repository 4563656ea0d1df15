"""What every editor shares (:class:`Editor`): the edited layers, the second moments of their inputs, the context
prefixes, the cache folder, the training-mode check and the per-fact record of a value search.

:class:`~editors.rome.ROME` edits one layer, :class:`~editors.memit.MEMIT` and :class:`~editors.alphaedit.AlphaEdit`
several; each adds its own ``compute`` / ``edit`` and :meth:`Editor.applier` (how an evaluation applies a batch).
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from .config import ROMEConfig
from .errors import EditError
from .evaluation.sequential import BatchApplier
from .layers import LinearLayer
from .passes.start_token import with_start_token
from .statistics.corpus import Corpus
from .statistics.keys import ContextPrefixes, load_or_generate_prefixes
from .statistics.second_moment import SecondMoment, default_cache_dir, layer_second_moments, statistics_fingerprint
from .value.loop import ValueResult

__all__ = ["Editor", "as_second_moment", "value_record"]


def as_second_moment(statistic: SecondMoment | torch.Tensor, layer: LinearLayer) -> SecondMoment:
    """A given ``C`` ``[d_in, d_in]`` as a :class:`SecondMoment` of ``layer``'s input (float64; a tensor gets no
    token count, fingerprint or corpus)."""
    if isinstance(statistic, SecondMoment):
        return statistic
    return SecondMoment(matrix=statistic.to(torch.float64), n_tokens=0, n_samples=0, input_node=layer.statistics_node,
                        fingerprint="", corpus=None)


def value_record(result: ValueResult, early_stop_loss: float, terms: Sequence[str]) -> dict[str, Any]:
    """One fact's value search as a JSON-able record: ``steps``, ``converged`` (last loss below ``early_stop_loss``),
    ``first_loss``, the last evaluation's ``terms`` (e.g. ``("loss", "target_prob")``, ``None`` when absent) and
    ``delta_norm`` (``‖δ‖``)."""
    last = result.history[-1] if result.history else {}
    return {"steps": result.steps, "converged": result.converged(early_stop_loss),
            "first_loss": result.history[0]["loss"] if result.history else None,
            **{term: last.get(term) for term in terms}, "delta_norm": float(result.delta.norm())}


class Editor(ABC):
    """The shared part of the editors: edited layers, statistics, context prefixes, cache folder (an abstract base:
    each editor defines :meth:`applier`).

    Args:
        pg: the model's :class:`gradpatch.PatchableGraph` (in ``eval()``).
        tokenizer: its tokenizer (left unchanged: the editor reads and scores texts with :attr:`tokenizer`).
        layers: the edited linear layers (in the order the editor uses them).
        config: hyperparameters (:class:`~editors.config.ROMEConfig` or a subclass).
        corpus: corpus of the statistics (``None``: the built-in Wikipedia summaries; a path; a list of strings; a
            :class:`~editors.statistics.Corpus`).
        statistics: precomputed ``C`` per layer (same order as ``layers``) instead of computing / loading them.

    Attributes:
        tokenizer: the tokenizer every text of the editor goes through: the given one, or a copy that puts
            ``config.start_token`` first (:func:`editors.passes.start_token.with_start_token`). Score and generate
            the edited model's texts with it.
        start_token: the token it puts first, as resolved (``None``: none).

    Raises:
        ValueError: ``statistics`` of another count than ``layers``; ``config.start_token`` not a token of the
            vocabulary, or a tokenizer that cannot put it first.
    """

    #: The method's name in records and on the command line (``"rome"``, ``"memit"``, ``"alphaedit"``).
    method = ""

    def __init__(self, pg: nn.Module, tokenizer: Any, layers: Sequence[LinearLayer], config: ROMEConfig,
                 corpus: Corpus | str | os.PathLike[str] | Any | None = None,
                 statistics: Sequence[SecondMoment | torch.Tensor] | None = None) -> None:
        self.pg = pg
        self.tokenizer = with_start_token(tokenizer, config.start_token)
        # with_start_token returns the caller's tokenizer when nothing is put first, else a copy whose BOS is the token
        self.start_token: str | None = None if self.tokenizer is tokenizer else self.tokenizer.bos_token
        self.layers: list[LinearLayer] = list(layers)
        self.config = config
        self.corpus = corpus
        self._layer_statistics: list[SecondMoment] | None = None
        if statistics is not None:
            if len(statistics) != len(self.layers):
                raise ValueError(f"{len(statistics)} statistics for {len(self.layers)} layers; give one per node")
            self._layer_statistics = [as_second_moment(s, layer) for s, layer in zip(statistics, self.layers)]
        self._templates: ContextPrefixes | None = None

    @property
    def nodes(self) -> list[str]:
        """NodePaths of the edited layers."""
        return [layer.path for layer in self.layers]

    def cache_dir(self) -> str | None:
        """The statistics / context prefix cache folder (``None`` with ``config.use_cache`` off)."""
        if not self.config.use_cache:
            return None
        return str(self.config.cache_dir) if self.config.cache_dir is not None else str(default_cache_dir())

    def check_eval(self) -> None:
        """Raise :class:`~editors.errors.EditError` if the graph is in training mode (dropout would randomise the
        edit)."""
        if getattr(self.pg, "training", False):
            raise EditError("The PatchableGraph is in training mode (dropout would randomise the edit): call pg.eval()")

    def layer_statistics(self) -> list[SecondMoment]:
        """``C`` at every edited layer's input (memoised; from the disk cache, the missing ones in one pass over the
        corpus)."""
        if self._layer_statistics is None:
            c = self.config
            self._layer_statistics = layer_second_moments(
                self.pg, self.tokenizer, self.layers, corpus=self.corpus, n_samples=c.n_samples,
                max_length=c.max_length, batch_size=c.stats_batch_size, cache_dir=c.cache_dir, use_cache=c.use_cache,
                progress=c.progress)
        return self._layer_statistics

    def templates(self) -> ContextPrefixes:
        """The context prefixes (memoised; read from / written to the disk cache, keyed by the model's fingerprint
        without the edited layers, so the editor's own edits do not change the key)."""
        if self._templates is None:
            c = self.config
            fingerprint = statistics_fingerprint(self.pg, skip=tuple(self.nodes))
            self._templates = load_or_generate_prefixes(self.pg, self.tokenizer, self.cache_dir(), fingerprint,
                                                        length_params=c.context_length_params, seed=c.template_seed)
        return self._templates

    @abstractmethod
    def applier(self) -> BatchApplier:
        """How :func:`~editors.evaluation.evaluate_sequential` writes a batch of requests with this editor."""

    def forget(self) -> None:
        """Drop what the editor remembers of the batches it applied, after their weights were restored by other
        means (AlphaEdit's earlier keys); nothing to drop here."""
