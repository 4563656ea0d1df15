"""Value search for many facts at once: ROME's objective (eq. 4), one forward and backward per step for a batch.

MEMIT (Meng et al. 2023, arXiv 2210.07229, §4.3, eqs. 15–16) finds, for every fact ``i`` of a batch, the change
``δ_i`` of the layer output at the subject's last token that makes the model say ``target_new``, with the objective
ROME uses for one fact (:class:`editors.value.ValueObjective`: target NLL over the context prompts, KL on
``"{subject} is a"``, weight decay, norm clamp). :class:`BatchValueObjective` puts the rows of many facts into one
right-padded batch, each with its own delta: ``δ`` is ``[F, d_out]`` and the :class:`gradpatch.AddPatch` at the
layer's output adds row ``δ[fact of row]`` at that row's subject position. The loss is the sum over facts of each
fact's own loss, so a fact's gradient is exactly the gradient of its own objective, and Adam (elementwise) moves each
row as it would move that fact's delta alone. Each fact stops when its loss is below ``early_stop_loss`` (its row is
frozen and its prompts leave the batch), as the one-fact search stops, so
:func:`editors.value.batch_search.optimize_values` returns the deltas one-at-a-time searches would return, up to float
rounding (``tests/editors/test_batch_value.py``).

Logits are computed only where the terms read them (:func:`editors.passes.selected_logits.logits_at`), the target tokens'
log-probabilities without a float32 log-softmax of every logit (:func:`editors.passes.token_log_probs.token_log_probs`), and
a step whose rows exceed ``max_tokens`` tokens runs as several forward/backward passes whose gradients add up before
the one optimizer step (memory: SmolLM2-135M keeps ~40 kB of activations per token and layer for the backward pass).
A model in bfloat16/float16 on CPU runs its attention with PyTorch's math backend (matrix products) during the search:
the fused CPU kernel's reduced-precision backward took 43 % of a bfloat16 step (docs/memit.md); the search in a
bfloat16 copy of a float32 model is :mod:`editors.value.search_copy` (its copy uses transformers' eager attention on the CPU,
faster still). With the prefix cache, a step runs each row's tokens from the subject's last one on; on a graph nobody
else runs (the search's copy) it runs them from the residual stream after the edited block
(:mod:`editors.passes.tail_pass`), the blocks up to it having run once per row.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from gradpatch import AddPatch
from gradpatch.model_io import model_device, model_dtype, pad_token_id, right_pad

from ..defaults import DEFAULT_MAX_TOKENS
from ..layers import LinearLayer
from ..passes.prefix_cache import PrefixCache, quiet_extraction, supports_prefix_cache
from ..passes.selected_logits import logits_at, output_embedding_input_node
from ..passes.tail_pass import TailPass, logits_match
from ..passes.token_log_probs import token_log_probs
from ..requests import EditRequest
from ..statistics.keys import ContextPrefixes
from .search import KL_PROMPT, ValuePrompts, encode_value_prompts, kl_context_prefix, value_terms
from .true_answer import TrueAnswerTerm

__all__ = ["BatchValueObjective", "math_attention", "search_attention"]

#: Passes of rows of similar length a group of facts runs in (less padding than one batch).
LENGTH_BUCKETS = 3
#: Fewest rows per such pass: a pass has a fixed cost whatever its rows (graph dispatch, cache assembly), so a few
#: facts' rows run as one pass (a lone fact's seven rows in three passes made its step slower than ROME's full pass).
MIN_BUCKET_ROWS = 32


def math_attention(pg: nn.Module) -> bool:
    """Whether the value search runs ``pg``'s attention with PyTorch's math backend: a bfloat16/float16 model on CPU,
    where the fused kernel's reduced-precision backward was 43 % of a search step (docs/memit.md)."""
    return model_device(pg).type == "cpu" and model_dtype(pg) in (torch.bfloat16, torch.float16)


def search_attention(pg: nn.Module) -> contextlib.AbstractContextManager[None]:
    """The attention backend of the value search's passes on ``pg`` (see :func:`math_attention`)."""
    return sdpa_kernel([SDPBackend.MATH]) if math_attention(pg) else contextlib.nullcontext()


class BatchValueObjective:
    """Eq. 4 of ROME for ``F`` facts: the loss of each fact as a function of its row of ``δ`` ``[F, d_out]``.

    Args:
        pg: the model's PatchableGraph (in ``eval()``).
        tokenizer: its tokenizer.
        layer: the layer whose output receives ``δ`` (for MEMIT, the last edited layer).
        requests: the ``F`` facts.
        templates: context prefixes of the rewriting prompts.
        v_init: ``[F, d_out]``: ``v₀`` per fact, the norm reference of the weight decay and the clamp.
        kl_factor, weight_decay, clamp_factor: as :class:`editors.value.ValueObjective`.
        kl_prompts: templates of the essence prompts.
        kl_in_context: read the KL prompts behind the first non-empty prefix of ``templates``
            (:func:`editors.value.search.kl_context_prefix`); ``False``: at the start of the text (the paper's).
        max_tokens: tokens (rows × padded width) per forward/backward pass; a step runs as several passes when
            the active facts' rows need more (one fact's rows always share a pass).
        prefix_cache: compute each row's tokens before the subject's last one once, as a KV cache
            (:class:`editors.passes.prefix_cache.PrefixCache`: they do not depend on ``δ``), and run only the rest at each
            step; used when the model takes a cache (:func:`editors.passes.prefix_cache.supports_prefix_cache`), full passes
            otherwise. Same losses up to float rounding.
        tail: with the prefix cache, run each step from the residual stream after the layer's block
            (:class:`editors.passes.tail_pass.TailPass`: the blocks up to it run once per row) if, on the first rows it runs,
            it gives the patched pass's logits and the patch adds to that stream what it adds to the layer's output
            (a warning and full passes if not). Only for a graph nobody else runs during the search (the search's
            own copy). Same losses up to float rounding.
        true_logit_weight: ``λ_true`` of the term that keeps each fact's true-answer logit
            (:class:`editors.value.true_answer.TrueAnswerTerm`; not in the papers); 0 (the default) leaves it out.

    Raises:
        ValueError: ``v_init`` is not ``[F, d_out]``, ``max_tokens`` is not positive, ``true_logit_weight`` is
            negative, or it is positive and a request has no ``target_true``, or ``kl_in_context`` and no non-empty
            prefix among ``templates``.
        SubjectNotFoundError, TokenizationError: a request cannot be encoded (the message names its subject).
    """

    def __init__(self, pg: nn.Module, tokenizer: Any, layer: LinearLayer, requests: Sequence[EditRequest],
                 templates: ContextPrefixes, v_init: torch.Tensor, kl_factor: float = 0.0625,
                 weight_decay: float = 1e-3, clamp_factor: float = 4.0, kl_prompts: tuple[str, ...] = (KL_PROMPT,),
                 kl_in_context: bool = False, max_tokens: int = DEFAULT_MAX_TOKENS, prefix_cache: bool = True,
                 tail: TailPass | None = None, true_logit_weight: float = 0.0) -> None:
        if tuple(v_init.shape) != (len(requests), layer.d_out):
            raise ValueError(f"v_init is {list(v_init.shape)}; expected [{len(requests)}, {layer.d_out}] "
                             f"(one v₀ per request)")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be positive, got {max_tokens}")
        self.pg, self.layer, self.requests = pg, layer, list(requests)
        self.true_answer = (TrueAnswerTerm(tokenizer, self.requests, true_logit_weight) if true_logit_weight
                            else None)  # checks the weight (editors.config.check_true_logit_weight) before the passes
        self.kl_factor, self.weight_decay, self.clamp_factor = kl_factor, weight_decay, clamp_factor
        self.v_init = v_init.detach()
        self.max_tokens = max_tokens
        self.device = model_device(pg)
        self.math_attention = math_attention(pg)
        self.pad = pad_token_id(tokenizer)
        self.prompts: list[ValuePrompts] = []
        kl_prefix = kl_context_prefix(templates, kl_in_context)
        for i, request in enumerate(self.requests):
            try:
                self.prompts.append(encode_value_prompts(tokenizer, request, templates, kl_prompts, kl_prefix))
            except ValueError as error:
                raise type(error)(f"Request {i} (subject {request.subject!r}): {error}") from None
        self.head_node = output_embedding_input_node(pg)
        self.prefix_cache = PrefixCache(pg, self.pad, max_tokens) if prefix_cache and supports_prefix_cache(pg) else None
        self.kl_reference: list[torch.Tensor | None] = [None] * len(self.requests)  # [n_kl, vocab] per fact
        self.tail = tail if self.prefix_cache is not None else None
        self.tail_checked = False  # whether the tail passes were compared with a full pass yet

    @property
    def n_facts(self) -> int:
        """``F``."""
        return len(self.requests)

    def chunks(self, facts: Sequence[int]) -> list[list[int]]:
        """Split ``facts`` into groups whose rows fit ``max_tokens`` (rows × widest row) per pass, facts of similar
        length together (less padding; the facts' losses are independent, so the grouping changes no result). With
        the prefix cache a row's width is its tokens from the subject's last one on (what a step runs)."""
        groups: list[list[int]] = []
        current: list[int] = []
        rows = width = 0
        widths = {fact: self._width(fact) for fact in facts}
        for fact in sorted(facts, key=widths.__getitem__):
            fact_rows = len(self.prompts[fact].sequences)
            new_rows, new_width = rows + fact_rows, max(width, widths[fact])
            if current and new_rows * new_width > self.max_tokens:
                groups.append(current)
                current, new_rows, new_width = [], fact_rows, widths[fact]
            current.append(fact)
            rows, width = new_rows, new_width
        if current:
            groups.append(current)
        return groups

    def _width(self, fact: int) -> int:
        """Tokens of ``fact``'s longest row at each step (from the subject's last token on with the prefix cache)."""
        prompts = self.prompts[fact]
        starts = prompts.subject_positions if self.prefix_cache is not None else [0] * len(prompts.sequences)
        return max(len(sequence) - start for sequence, start in zip(prompts.sequences, starts))

    def loss(self, delta: torch.Tensor, facts: Sequence[int]) -> dict[str, torch.Tensor]:
        """The terms of ``facts`` (one forward pass; differentiable with respect to ``delta``).

        The KL reference of a fact is taken from its first evaluation, which must be at ``δ = 0`` (the search starts
        there).

        Args:
            delta: ``[F, d_out]`` (an ``nn.Parameter`` during optimisation).
            facts: indices of the facts evaluated in this pass.

        Returns:
            ``{"loss", "nll", "kl", "weight_decay", "target_prob"}``, each ``[len(facts)]``; with the true-answer
            term also ``"true_logit_drop"`` (its mean hinged drop, before ``λ_true``; included in ``"loss"``).

        Raises:
            ValueError: a fact is evaluated first at a non-zero ``δ``.
        """
        sequences, keys, batch = self._batch(facts)
        device = self.device
        fact_ids = torch.tensor(list(facts), device=device)
        values = delta[fact_ids][batch["row_fact"]]  # [rows, d_out]: each row gets its own fact's δ
        n_tokens = len(batch["tokens"])
        token_parts, token_reads, kl_parts, kl_reads, true_parts = [], [], [], [], []
        true_tokens = (None if self.true_answer is None else
                       self.true_answer.read_tokens(facts, batch["prompt_fact"][batch["token_prompt"]]))  # [n_tokens]
        with search_attention(self.pg):
            passes = self._logits(sequences, keys, values, batch["patch_cols"], batch["read_rows"],
                                  batch["read_cols"])
        for logits, reads in passes:  # each pass's target-token reads come before its KL reads
            n_target = int((reads < n_tokens).sum())
            target_logits, kl_logits = logits.split([n_target, len(reads) - n_target])  # split: no zero-fill
            token_parts.append(token_log_probs(target_logits, batch["tokens"][reads[:n_target]]))
            if true_tokens is not None:
                true_tokens_here = true_tokens[reads[:n_target]].unsqueeze(1)  # [n_target, 1]
                true_parts.append(target_logits.gather(1, true_tokens_here).squeeze(1).float())
            kl_parts.append(torch.log_softmax(kl_logits.float(), dim=-1))
            token_reads.append(reads[:n_target])
            kl_reads.append(reads[n_target:] - n_tokens)
        token_lp = _in_read_order(torch.cat(token_parts), torch.cat(token_reads))  # [target tokens]
        kl_lp = _in_read_order(torch.cat(kl_parts), torch.cat(kl_reads))  # [KL prompts, vocab]
        n_prompts = len(batch["prompt_fact"])
        per_prompt = (token_lp.new_zeros(n_prompts).index_add(0, batch["token_prompt"], token_lp)
                      / batch["prompt_lengths"])
        reference = self._kl_reference(facts, kl_lp, delta)
        terms = value_terms(per_prompt, batch["prompt_fact"], kl_lp, reference, batch["kl_fact"], delta[fact_ids],
                            self.v_init[fact_ids], self.kl_factor, self.weight_decay)
        if self.true_answer is not None:
            true_logits = _in_read_order(torch.cat(true_parts), torch.cat(token_reads))  # [target tokens]
            drop = self.true_answer.drop(facts, true_logits, batch["token_prompt"], batch["prompt_fact"])
            terms["loss"] = terms["loss"] + self.true_answer.weight * drop
            terms["true_logit_drop"] = drop
        return terms

    def _logits(self, sequences: list[list[int]], keys: list[tuple[int, int]], values: torch.Tensor,
                patch_cols: torch.Tensor, read_rows: torch.Tensor, read_cols: torch.Tensor
                ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Logits at ``(read_rows, read_cols)`` with ``values[r]`` added at row ``r``'s ``patch_cols[r]``, per pass:
        ``(logits [m, vocab], reads [m])``, ``reads`` the ascending indices into ``read_rows`` of the pass's rows
        (the logits are not gathered into one tensor in read order: that copy and its backward pass cost as much as
        the log-softmax). The rows run in up to :data:`LENGTH_BUCKETS` passes of rows of similar length, each of at
        least :data:`MIN_BUCKET_ROWS` rows (a fact's prompts range from its KL prompt to ten-token prefixes: one padded
        batch would be a quarter padding); the passes share one autograd graph, so the caller's backward covers them
        all. With the prefix cache each row runs from its ``patch_cols`` on (``keys`` name the rows' cached
        prefixes)."""
        splits = patch_cols.tolist() if self.prefix_cache is not None else [0] * len(sequences)
        order = sorted(range(len(sequences)), key=lambda r: len(sequences[r]) - splits[r])
        size = -(-len(order) // max(1, min(LENGTH_BUCKETS, len(order) // MIN_BUCKET_ROWS)))
        rows_of_read = read_rows.tolist()
        parts = []
        for start in range(0, len(order), size):
            rows = order[start : start + size]
            local = {row: i for i, row in enumerate(rows)}
            picks = [j for j, row in enumerate(rows_of_read) if row in local]
            if not picks:
                continue
            index = torch.tensor(rows, device=self.device)
            offsets = torch.tensor([splits[row] for row in rows], device=self.device)
            local_rows = torch.tensor([local[rows_of_read[j]] for j in picks], device=self.device)
            reads = torch.tensor(picks, device=self.device)
            local_cols = read_cols[reads] - offsets[local_rows]
            if self.prefix_cache is None:
                inputs = {"input_ids": right_pad([sequences[row] for row in rows], self.pad)[0].to(self.device),
                          "use_cache": False}
                logits = self._full_logits(inputs, values[index], patch_cols[index], local_rows, local_cols)
            else:
                row_keys = [keys[row] for row in rows]
                self.prefix_cache.fill(row_keys, [sequences[row][: splits[row]] for row in rows])
                suffixes = [sequences[row][splits[row] :] for row in rows]
                logits = self._cached_logits(row_keys, suffixes, values[index], local_rows, local_cols)
            parts.append((logits, reads))
        return parts

    def _full_logits(self, inputs: dict[str, Any], values: torch.Tensor, patch_cols: torch.Tensor,
                     rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        """Logits ``[n, vocab]`` at ``(rows, cols)`` of one pass of the engine, ``values[r]`` added at row ``r``'s
        ``patch_cols[r]`` of the layer's output."""
        patch = AddPatch(value=values, slice=(torch.arange(len(values), device=self.device), patch_cols))
        model_kwargs = dict(inputs)
        with quiet_extraction():
            return logits_at(self.pg, model_kwargs.pop("input_ids"), rows, cols, {self.layer.output_node: patch},
                             head_node=self.head_node, model_kwargs=model_kwargs)

    def _cached_logits(self, row_keys: list[tuple[int, int]], suffixes: list[list[int]], values: torch.Tensor,
                       rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        """:meth:`_full_logits` of rows whose prefixes are cached (``values`` added at each suffix's first token),
        through :attr:`tail` once it matched a full pass on the first rows it ran (else the full pass)."""
        inputs = self.prefix_cache.inputs(row_keys, suffixes)
        first = torch.zeros(len(values), dtype=torch.long, device=self.device)  # δ goes at each suffix's first token
        if self.tail is None:
            return self._full_logits(inputs, values, first, rows, cols)
        if not self.tail.holds(row_keys):  # (building a pass's inputs copies the prefixes' cache)
            self.tail.fill(row_keys, [len(s) for s in suffixes], self.prefix_cache.inputs(row_keys, suffixes))
        if self.tail_checked:
            return self.tail.logits(row_keys, values, rows, cols, inputs)
        self.tail_checked = True  # the first rows run both ways: the tail is used if it gives the same logits
        logits = self._full_logits(inputs, values, first, rows, cols)
        with torch.no_grad():
            same = (logits_match(self.tail.logits(row_keys, values, rows, cols,
                                                  self.prefix_cache.inputs(row_keys, suffixes)), logits)
                    and self.tail.adds_to_stream(self.prefix_cache.inputs(row_keys, suffixes),
                                                 self.layer.output_node, row_keys))
        if not same:
            warnings.warn(f"Adding δ to the residual stream after {self.tail.residual_node} does not give the "
                          f"patched logits of {self.layer.output_node} for this model; the value search runs full "
                          f"passes", stacklevel=2)
            self.tail.discard(row_keys)
            self.tail = None
        return logits

    def _batch(self, facts: Sequence[int]) -> tuple[list[list[int]], list[tuple[int, int]], dict[str, torch.Tensor]]:
        """The rows of ``facts``, their keys ``(fact, prompt)`` and the positions the terms read: every target
        token's logit position first, then every KL prompt's last position; facts are numbered by their slot in
        ``facts``."""
        sequences: list[list[int]] = []
        keys: list[tuple[int, int]] = []
        lists: dict[str, list[int]] = {name: [] for name in (
            "patch_cols", "row_fact", "target_rows", "target_cols", "tokens", "token_prompt", "prompt_fact",
            "prompt_lengths", "kl_rows", "kl_cols", "kl_fact")}
        for slot, fact in enumerate(facts):
            prompts = self.prompts[fact]
            offset, first_prompt = len(sequences), len(lists["prompt_fact"])
            sequences += prompts.sequences
            keys += self._row_keys(fact)
            lists["patch_cols"] += prompts.subject_positions
            lists["row_fact"] += [slot] * len(prompts.sequences)
            for row, col, token in prompts.targets:
                lists["target_rows"].append(offset + row)
                lists["target_cols"].append(col)
                lists["tokens"].append(token)
                lists["token_prompt"].append(first_prompt + row)
            lists["prompt_fact"] += [slot] * len(prompts.rewrite)
            lists["prompt_lengths"] += [e.n_target for e in prompts.rewrite]
            for k in range(len(prompts.rewrite), len(prompts.sequences)):
                lists["kl_rows"].append(offset + k)
                lists["kl_cols"].append(len(prompts.sequences[k]) - 1)
                lists["kl_fact"].append(slot)
        device = self.device
        batch = {name: torch.tensor(values, device=device) for name, values in lists.items()}
        batch["prompt_lengths"] = batch["prompt_lengths"].float()
        batch["read_rows"] = torch.cat([batch["target_rows"], batch["kl_rows"]])
        batch["read_cols"] = torch.cat([batch["target_cols"], batch["kl_cols"]])
        return sequences, keys, batch

    def _kl_reference(self, facts: Sequence[int], kl_lp: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """The ``δ = 0`` log-probabilities of ``facts``' KL prompts ``[Q, vocab]``, kept from each fact's first
        evaluation (which must be at ``δ = 0``)."""
        parts = []
        start = 0
        for fact in facts:
            n_kl = self.prompts[fact].n_kl
            if self.kl_reference[fact] is None:
                if bool(delta[fact].detach().abs().max() > 0):
                    raise ValueError(f"Fact {fact} ({self.requests[fact].subject!r}) is evaluated first at a "
                                     f"non-zero δ; the batched search starts every fact at δ = 0")
                self.kl_reference[fact] = kl_lp[start : start + n_kl].detach()
            parts.append(self.kl_reference[fact])
            start += n_kl
        return torch.cat(parts)

    def release(self, facts: Sequence[int]) -> None:
        """Free what is kept for ``facts`` only while they are searched (their rows' prefix caches): call it when
        they stop; evaluating them again recomputes it."""
        keys = [key for fact in facts for key in self._row_keys(fact)]
        if self.prefix_cache is not None:
            self.prefix_cache.discard(keys)
        if self.tail is not None:
            self.tail.discard(keys)

    def _row_keys(self, fact: int) -> list[tuple[int, int]]:
        """The keys ``(fact, prompt)`` of a fact's rows (its prefix-cache entries)."""
        return [(fact, k) for k in range(len(self.prompts[fact].sequences))]

    @torch.no_grad()
    def project_(self, delta: torch.Tensor) -> None:
        """Clamp every row ``‖δ_i‖ ≤ clamp_factor · ‖v₀_i‖`` in place (after each optimiser step)."""
        max_norm = self.clamp_factor * self.v_init.norm(dim=-1, keepdim=True)  # [F, 1]
        norm = delta.norm(dim=-1, keepdim=True)
        delta.mul_(torch.where(norm > max_norm, max_norm / norm.clamp_min(1e-30), torch.ones_like(norm)))


def _in_read_order(values: torch.Tensor, reads: torch.Tensor) -> torch.Tensor:
    """``values`` (rows in pass order, row ``i`` read ``reads[i]``) with its rows put in read order."""
    return values[torch.argsort(reads)]
