"""MEMIT (Meng, Sen Sharma, Andonian, Belinkov, Bau 2023, *Mass-Editing Memory in a Transformer*, arXiv 2210.07229):
many facts written at once into several linear layers chosen by NodePath.

For ``F`` facts and edited layers ``l_1 < ... < l_m`` (e.g. ``model.layers_{2..6}.mlp.down_proj``), following §4.3
and Algorithm 1 of the paper:

1. **Target residuals** (eqs. 15–16): ``z_i = h_i^L + δ_i``, ``h^L`` the residual stream after the last edited layer's
   block at the subject's last token, ``δ_i`` found by ROME's value objective at that layer's output (the output is
   added to the residual stream there), all facts in one batched search (:mod:`editors.value.batch_objective`).
2. **Spread over the layers**: for each layer ``l_j`` in order, with the updates of the earlier layers in place (as
   patches holding the weights the edit will write, :func:`editors.edits.patches.updated_weight_patches`: no weight is
   written while computing), measure each fact's key ``k_i`` at ``l_j`` (the layer input at the subject's last token,
   averaged over the context prefixes, eq. 3 of ROME) and its current ``h_i^L``; the layer takes the share
   ``r_i = (z_i − h_i^L) / (m − j + 1)`` of what is left.
3. **Update** (eq. 14): ``ΔW = R Kᵀ (λ C + K Kᵀ)⁻¹`` per layer, ``C = E[k kᵀ]`` from the statistics cache
   (:mod:`editors.statistics.second_moment`; all layers' statistics in one pass over the corpus), ``λ`` =
   ``mom2_update_weight`` when given, else ``mom2_relative_weight`` times the edited keys' mean ``kᵀC⁻¹k`` at that
   layer (:meth:`MEMIT.update_weight`; recorded per layer in ``info["layers"]``). ``keys_per_context``: a column of
   ``K`` per context key; ``subject_first_key``: one more, the subject-first key (``λ`` from the others).

A node may be one expert of an MoE block, ``model.layers_3.mlp.experts.down_proj[e]`` (named: one solve per layer;
:mod:`editors.layers.experts`): its keys are computed from the block input, and since its change reaches the block
output times its router weight, each fact's share is divided by that weight (:func:`editors.memit_setup.layer_residuals`).

The result is a :class:`editors.edits.batch.BatchEdit`: one rank-``F`` edit per layer, applied and restored as one.
AlphaEdit (:mod:`editors.alphaedit`) is this pipeline with another update (step 3).

Usage::

    memit = MEMIT(pg, tokenizer, [f"model.layers_{i}.mlp.down_proj" for i in range(2, 7)])
    batch = memit.edit(requests)        # computed and applied in place
    batch.restore(pg)                   # bit-identical original weights
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from gradpatch import PatchableGraph, model_fingerprint
from gradpatch.model_io import model_device, model_dtype, wrapped_model

from .config import MEMITConfig
from .defaults import DEFAULT_SMOLLM2_NODES
from .distributed.shards import FactShards
from .editor import Editor, value_record
from .edits.batch import BatchEdit
from .edits.edit import Edit
from .edits.patches import updated_weight_patches
from .errors import EditError
from .evaluation.sequential import BatchApplier, batch_applier
from .layers import resolve_layer
from .memit_setup import (check_adds_to_residual, check_experts, check_requests, forward_order, layer_residuals,
                          residual_node_of)
from .passes.tail_pass import tail_pass_for
from .requests import EditRequest
from .solve.multi_update import added, memit_factors, relative_update_weight
from .statistics.corpus import Corpus
from .statistics.keys import ContextPrefixes, context_activations, key_moments, subject_first_activations
from .statistics.second_moment import SecondMoment
from .value.batch_objective import BatchValueObjective
from .value.batch_search import BatchStepCallback, optimize_values
from .value.loop import ValueResult
from .value.search_copy import SearchCopy, search_dtype

__all__ = ["DEFAULT_SMOLLM2_NODES", "MEMIT", "MEMITConfig", "check_requests", "residual_node_of"]


class MEMIT(Editor):
    """Compute and apply MEMIT edits of many facts at several linear layers of a PatchableGraph.

    Statistics and context prefixes are computed once per instance (statistics cached on disk, all layers in one
    pass over the corpus).

    Args:
        pg: the model's :class:`gradpatch.PatchableGraph` (in ``eval()``).
        tokenizer: its tokenizer.
        nodes: NodePaths of the edited linear layers (any order; they are used in forward order), e.g.
            ``[f"model.layers_{i}.mlp.down_proj" for i in range(2, 7)]``. Their outputs must all have the width of
            the residual stream.
        config: hyperparameters.
        corpus: corpus of the statistics (as :class:`editors.ROME`).
        statistics: precomputed ``C`` per layer (same order as ``nodes``) instead of computing / loading them.
        residual_node: NodePath of the residual stream after the last layer's block (default: derived, e.g.
            ``model.layers_6.output``; see :func:`residual_node_of`).
        shards: the processes the facts are split across (default: this one holds every fact); e.g.
            :class:`editors.distributed.TorchDistributedShards` under DDP: each rank runs the key passes and the value
            search of its share, and every rank gets the same edit.

    Raises:
        KeyError, LayerKindError: a NodePath is not a linear layer of the graph (the message names it), is a fused
            MoE experts weight without an expert index, or the model's family (the layout table) puts a post-norm or a
            multiplier between the layers and the residual stream (unless ``residual_node`` is given).
        ValueError: no node, a node given twice, statistics of another count, layers of different output widths, or
            a ``config.value_dtype`` that is not a floating-point dtype name.
    """

    method = "memit"

    def __init__(self, pg: nn.Module, tokenizer: Any, nodes: Sequence[str], config: MEMITConfig | None = None,
                 corpus: Corpus | str | os.PathLike[str] | Any | None = None,
                 statistics: Sequence[SecondMoment | torch.Tensor] | None = None,
                 residual_node: str | None = None, shards: FactShards | None = None) -> None:
        if not nodes:
            raise ValueError("MEMIT needs at least one NodePath of a linear layer to edit")
        if len(set(nodes)) != len(nodes):
            raise ValueError(f"A NodePath is given twice in {list(nodes)}; give each layer once")
        given = [resolve_layer(pg, node) for node in nodes]
        check_experts(given)
        if residual_node is None and isinstance(pg, PatchableGraph):
            check_adds_to_residual(pg)
        layers = forward_order(pg, tokenizer, given)
        widths = {layer.path: layer.d_out for layer in layers}
        if len(set(widths.values())) != 1:
            raise ValueError(f"The edited layers' outputs differ in width ({widths}); MEMIT spreads one residual "
                             f"over them: pick layers that write to the residual stream (e.g. MLP down_proj)")
        if statistics is not None:
            if len(statistics) != len(nodes):
                raise ValueError(f"{len(statistics)} statistics for {len(nodes)} layers; give one per node")
            by_node = dict(zip([layer.path for layer in given], statistics))
            statistics = [by_node[layer.path] for layer in layers]
        super().__init__(pg, tokenizer, layers, config or MEMITConfig(), corpus=corpus, statistics=statistics)
        self.config: MEMITConfig
        self.residual_node = residual_node or residual_node_of(
            self.layers[-1], pg if isinstance(pg, PatchableGraph) else None)
        self.shards = shards or FactShards()
        search_dtype(self.config.value_dtype)  # a bad name fails here, not after the statistics
        self._search_copy: SearchCopy | None = None
        self.last_values: list[ValueResult] = []
        self.preserved: list[torch.Tensor] = []  # K_n K_nᵀ per layer from preserve(), [d_in, d_in] float64
        self.n_preserved = 0  # facts given to preserve()

    def statistics(self) -> list[SecondMoment]:
        """``C`` at every layer's input, in forward order (memoised; from the disk cache, the missing ones in one
        pass)."""
        return self.layer_statistics()

    def applier(self) -> BatchApplier:
        """A batch's facts edited at once (:func:`~editors.evaluation.batch_applier` over :meth:`edit`)."""
        return batch_applier(self.pg, self.edit)

    def _search_graph(self) -> nn.Module:
        """The graph the value search runs on: ``pg``, or its copy in ``config.value_dtype`` (made on first use, its
        weights refreshed from the model at every call)."""
        dtype = search_dtype(self.config.value_dtype)
        if dtype is None or dtype == model_dtype(self.pg):
            return self.pg
        if self._search_copy is None or self._search_copy.dtype != dtype:
            self._search_copy = SearchCopy(self.pg, self.tokenizer, dtype)
        return self._search_copy.graph()

    def preserve(self, facts: Sequence[tuple[str, str]], weight: float = 1.0) -> None:
        """Keep the outputs of these subjects' keys through every later update of this editor.

        Each ``(prompt, subject)``'s key at each edited layer (the layer input at the subject's last token, averaged
        over the key prefixes as an edited fact's key, measured on the model as it is now) is added, times
        ``weight``, to the preserved term of the update: ``K_n K_nᵀ`` in MEMIT's ``λC + K_n K_nᵀ + KKᵀ``
        (:func:`editors.solve.multi_update.memit_factors`: more columns of eq. 14's preserved keys ``K_0``), and in
        AlphaEdit's ``K_p K_pᵀ`` (the term that keeps earlier batches' keys). ``C`` comes from generic text, so it
        cannot tell an edited subject from others that share its relation and old object (other cities of its
        country: docs/memit.md, "Why the null space does not protect them"); preserving such subjects (never the
        ones a test evaluates) gives the update their directions. Calls add up; :meth:`AlphaEdit.forget` keeps them.

        Args:
            facts: ``(prompt, subject)`` pairs, the prompt with ``{}`` where the subject goes, e.g.
                ``("The city of {} is located in the country of", "Lyon")``.
            weight: the factor of their outer products (> 0; 1 weighs each key as one edited fact's key).

        Raises:
            ValueError: no fact, or a weight that is not positive.
            SubjectNotFoundError, TokenizationError: a fact cannot be encoded (its index is named).
        """
        if not facts:
            raise ValueError("preserve() needs at least one (prompt, subject) pair")
        if not weight > 0:
            raise ValueError(f"The preservation weight must be positive, got {weight!r}")
        self.preserved = added(self.preserved, [weight * m for m in self._key_moments(facts, False, False)])
        self.n_preserved += len(facts)

    def _key_moments(self, facts: Sequence[tuple[str, str]], per_context: bool, first: bool) -> list[torch.Tensor]:
        """:func:`~editors.statistics.keys.key_moments` (``first``: its ``subject_first``) at every edited layer."""
        return key_moments(self.pg, self.tokenizer, self.layers, facts,
                           self.templates().subset(self.config.key_prefixes), per_context, first,
                           self.config.max_tokens)

    def _preserved(self, index: int) -> torch.Tensor | None:
        """``K_n K_nᵀ`` of layer ``index`` (:meth:`preserve`), or ``None``."""
        return self.preserved[index] if self.preserved else None

    def update_weight(self, index: int, keys: torch.Tensor) -> float | None:
        """``λ`` of eq. 14 at layer ``index`` for these keys (``[F, d_in]`` or ``[F, P, d_in]``):
        ``config.mom2_update_weight`` when given, else ``config.mom2_relative_weight`` times the keys' mean
        ``kᵀC⁻¹k`` (:func:`editors.solve.multi_update.relative_update_weight`).

        Raises:
            StatisticsError: the layer's ``C`` is not positive definite (relative weight only).
        """
        c = self.config
        if c.mom2_update_weight is not None:
            return c.mom2_update_weight
        return relative_update_weight(keys, self.statistics()[index].matrix, c.mom2_relative_weight,
                                      node=self.layers[index].path)

    def _layer_update(self, index: int, keys: torch.Tensor, residuals: torch.Tensor, weight: float | None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """Eq. 14 at layer ``index`` with ``λ = weight`` (:meth:`update_weight`) and the preserved keys: factors
        ``(U [d_in, F], V [d_out, F])``."""
        assert weight is not None
        return memit_factors(keys, residuals, self.statistics()[index].matrix, weight,
                             node=self.layers[index].path, preserved=self._preserved(index))

    def compute(self, requests: Sequence[EditRequest], callback: BatchStepCallback | None = None) -> BatchEdit:
        """Compute the edit of ``requests`` without touching the weights.

        Args:
            requests: the facts of the batch.
            callback: called after each step of the batched value search with ``(step, {fact: terms})``.

        Returns:
            The :class:`BatchEdit` (not applied); ``info["facts"]`` holds each fact's value search (steps, converged,
            losses, target probability, ``‖δ‖``), ``info["timings_s"]`` the phases (this process's),
            ``info["processes"]`` how many processes split the facts, ``info["start_token"]`` the token every text was
            read after (``None``: none).

        Raises:
            EditError: the graph is in training mode, or the residual node is not as wide as the layers' outputs.
            ConflictingRequestsError: one subject with two targets.
            SubjectNotFoundError, TokenizationError: a request cannot be encoded (named).
            StatisticsError: a layer's system is singular (named).
            NonFiniteError: the value search went non-finite (the fact is named).
            EditError: with several processes, fewer facts than processes, or processes given other requests or
                another model.
        """
        self.check_eval()
        requests = check_requests(requests)
        fingerprint = model_fingerprint(wrapped_model(self.pg))
        span = self.shards.span(len(requests))  # this process's facts (all of them in one process)
        self.shards.agree({"model": fingerprint, "requests": [repr(r) for r in requests]},
                          "model or requests (every process must load the same model and get the same requests)")
        c, layers, last = self.config, self.layers, self.layers[-1]
        statistics = self.statistics()
        templates = self.templates()
        key_templates, value_templates = templates.subset(c.key_prefixes), templates.subset(c.value_prefixes)
        self.shards.agree(list(templates.prefixes), "context prefixes (sampled from the model: seed every process "
                                                    "alike, or let them read the prefix cache)")
        facts = [(r.prompt, r.subject) for r in requests]
        t0 = time.perf_counter()
        first, at_last, h_start = self._gathered(lambda: context_activations(
            self.pg, self.tokenizer, [layers[0].input_node, last.input_node, self.residual_node],
            facts[span.start:span.stop], key_templates, max_tokens=c.max_tokens), len(facts))  # [F, P, d_in], ...
        with torch.no_grad():  # k* at the last layer (an MoE expert computes its keys from the block input)
            at_last, h_start = last.keys_of(at_last).mean(dim=1), h_start.mean(dim=1)
        if h_start.shape[-1] != last.d_out:
            raise EditError(f"The residual node {self.residual_node} is {h_start.shape[-1]} wide but {last.path} "
                            f"writes {last.d_out}; pass residual_node= (the stream the layer's output is added to)")
        with torch.no_grad():
            v_init = last.forward_value(at_last)  # [F, d_out]
        t1 = time.perf_counter()
        search_pg = self._search_graph()
        tail = tail_pass_for(search_pg, self.residual_node) if search_pg is not self.pg else None  # the copy only
        objective = BatchValueObjective(search_pg, self.tokenizer, resolve_layer(search_pg, last.path),
                                        requests[span.start:span.stop], value_templates, v_init[span.start:span.stop],
                                        kl_factor=c.kl_factor, kl_in_context=c.kl_in_context, tail=tail,
                                        weight_decay=c.weight_decay, clamp_factor=c.clamp_factor,
                                        max_tokens=c.max_tokens, true_logit_weight=c.true_logit_weight)
        shifted = None if callback is None else (  # the callback numbers facts in the whole batch
            lambda step, terms: callback(step, {span.start + fact: value for fact, value in terms.items()}))
        results = self.shards.collect(lambda: optimize_values(
            objective, steps=c.steps, lr=c.lr, early_stop_loss=c.early_stop_loss, callback=shifted), len(facts))
        self.last_values = results
        deltas = torch.stack([r.delta for r in results]).to(h_start.device, torch.float64)  # [F, d_out]: z - h^L
        t2 = time.perf_counter()
        edits: list[Edit] = []
        patches: dict[str, list[Any]] = {}
        layer_info = []
        for j, layer in enumerate(layers):
            if j == 0:
                keys, h_now = first, h_start
            else:
                keys, h_now = self._gathered(lambda: context_activations(
                    self.pg, self.tokenizer, [layer.input_node, self.residual_node], facts[span.start:span.stop],
                    key_templates, patches=patches, max_tokens=c.max_tokens), len(facts))
                h_now = h_now.mean(dim=1)
            hidden = keys  # the layer's input [F, P, d]: its keys (an expert's: from the block input, and its routing)
            with torch.no_grad():
                keys = layer.keys_of(hidden)
            keys = keys if c.keys_per_context else keys.mean(dim=1)  # [F, P, d_in] or k* per fact [F, d_in]
            left = deltas - (h_now - h_start).to(torch.float64)  # z - h^L now, [F, d_out]
            weight = self.update_weight(j, keys)  # λ from the context keys: the subject-first column leaves it
            if c.subject_first_key:
                keys = self._with_subject_first(j, keys, facts, span, patches)  # [F, P + 1, d_in] or [F, 2, d_in]
            u, v = self._layer_update(j, keys, layer_residuals(layer, hidden, left / (len(layers) - j)), weight)
            edits.append(Edit(node=layer.path, u=u, v=v))
            for node, items in updated_weight_patches(layer, u, v).items():
                patches.setdefault(node, []).extend(items)
            layer_info.append({"node": layer.path, "residual_left_norm": float(left.norm(dim=-1).mean()),
                               "key_norm": float(keys.norm(dim=-1).mean()), "rank": int(u.shape[1]),
                               "mom2_update_weight": weight})
        t3 = time.perf_counter()
        info = self._info(requests, results, statistics, layer_info, key_templates, value_templates,
                          {"keys": t1 - t0, "value": t2 - t1, "update": t3 - t2})
        return BatchEdit(edits=edits, requests=requests, model_fingerprint=fingerprint, info=info)

    def _with_subject_first(self, index: int, keys: torch.Tensor, facts: Sequence[tuple[str, str]], span: range,
                            patches: dict[str, list[Any]]) -> torch.Tensor:
        """``keys`` (``[F, P, d_in]`` or ``[F, d_in]``) and each fact's subject-first key (on the model with the earlier
        layers' updates ``patches``) as one more column: ``[F, P + 1, d_in]`` or ``[F, 2, d_in]``."""
        layer = self.layers[index]
        first = self._gathered(lambda: subject_first_activations(
            self.pg, self.tokenizer, [layer.input_node], [subject for _, subject in facts[span.start:span.stop]],
            patches=patches, max_tokens=self.config.max_tokens), len(facts))[0]  # [F, 1, d]
        with torch.no_grad():
            first = layer.keys_of(first)  # [F, 1, d_in]
        columns = keys if keys.dim() == 3 else keys.unsqueeze(1)
        return torch.cat([columns, first.to(columns.dtype)], dim=1)

    def _gathered(self, compute: Callable[[], Sequence[torch.Tensor]], n: int) -> list[torch.Tensor]:
        """``compute()``'s per-fact tensors (each ``[F_here, ...]``, this process's facts) gathered from every process
        into ``[F, ...]`` in request order, on this process's model device (one process: ``compute()`` unchanged)."""
        if self.shards.world_size == 1:
            return list(compute())
        rows = self.shards.collect(lambda: list(zip(*(t.unbind(0) for t in compute()))), n)
        device = model_device(self.pg)
        return [torch.stack([row[j] for row in rows]).to(device) for j in range(len(rows[0]))]

    def _info(self, requests: list[EditRequest], results: list[ValueResult], statistics: list[SecondMoment],
              layers: list[dict[str, Any]], key_templates: ContextPrefixes, value_templates: ContextPrefixes,
              timings: dict[str, float]) -> dict[str, Any]:
        c = self.config
        facts = [{"subject": request.subject} | value_record(result, c.early_stop_loss, ("loss", "target_prob"))
                 for request, result in zip(requests, results)]
        return {
            "method": self.method,
            "nodes": self.nodes,
            "residual_node": self.residual_node,
            "n_facts": len(requests),
            "preserved_facts": self.n_preserved,
            "converged": all(f["converged"] for f in facts),
            "n_key_prompts": len(key_templates),
            "n_value_prompts": len(value_templates),
            "start_token": self.start_token,
            "statistics": [{"node": s.input_node, "n_tokens": s.n_tokens, "n_samples": s.n_samples, "corpus": s.corpus}
                           for s in statistics],
            "layers": layers,
            "facts": facts,
            "timings_s": timings,
            "processes": self.shards.world_size,
            "config": c.to_json(),
        }

    def edit(self, requests: Sequence[EditRequest], callback: BatchStepCallback | None = None) -> BatchEdit:
        """Compute the edit of ``requests`` and apply it in place (``batch.restore(pg)`` undoes it exactly).

        Several calls edit several batches in sequence, each computed on the model with the earlier ones applied. A
        failure leaves the weights as they were.

        Raises:
            EditNotConvergedError: a fact's value search did not converge and ``config.allow_unconverged`` is False.
            The errors of :meth:`compute`.
        """
        batch = self.compute(requests, callback=callback)
        return batch.apply(self.pg, allow_unconverged=self.config.allow_unconverged)
