"""Context templates and the key ``k*`` (Meng et al. 2022, section 3.1, eq. 3).

The key of a subject is the edited layer's input at the subject's last token. To make it represent the subject
rather than one prompt, ROME averages it over the prompt behind short context prefixes::

    k* = 1/N Σ_j k(x_j + prompt(subject))                                            (eq. 3)

The prefixes (the paper's *context templates*) are sampled from the model itself: 10 continuations of 5
tokens and 10 of 10 tokens after the starters "The", "Therefore", "Because", "I", "You" (top-k 5 sampling
with a fixed seed, special tokens banned), each followed by ". ", plus the empty prefix: 21 in all. They are
cached in memory by the editor and on disk next to the statistics.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gradpatch.files.atomic import atomic_write_text
from gradpatch.model_io import logits_of, model_device, pad_token_id, right_pad

from ..defaults import LENGTH_PARAMS
from ..errors import CacheRecomputedWarning, SubjectNotFoundError
from ..layers import LinearLayer
from ..passes.shared_prefix import row_activations
from ..passes.start_token import start_token_tag
from ..passes.tokens import EncodedPrompt, encode_subject_prompt, format_with_span

__all__ = ["ContextPrefixes", "compute_key", "context_activations", "generate_context_prefixes", "key_moments",
           "load_or_generate_prefixes", "subject_first_activations"]

STARTERS: tuple[str, ...] = ("The", "Therefore", "Because", "I", "You")


@dataclass(frozen=True)
class ContextPrefixes:
    """Context prefixes placed before the prompt (the empty prefix first).

    Attributes:
        prefixes: e.g. ``("", "The first thing I noticed. ", ...)``.
    """

    prefixes: tuple[str, ...]

    def __len__(self) -> int:
        return len(self.prefixes)

    def subset(self, n: int | None) -> "ContextPrefixes":
        """``n`` prefixes: the first (empty) one and ``n - 1`` spread evenly over the others (all if ``None``)."""
        if n is None or n >= len(self.prefixes):
            return self
        if n < 1:
            raise ValueError(f"Need at least one context prefix, got n={n}")
        rest = len(self.prefixes) - 1
        picks = sorted({1 + round(i * (rest - 1) / max(n - 2, 1)) for i in range(n - 1)}) if n > 1 else []
        return ContextPrefixes(prefixes=(self.prefixes[0],) + tuple(self.prefixes[i] for i in picks))


@torch.no_grad()
def _sample(forward: Any, tokenizer: Any, starters: Sequence[str], n_new: int, generator: torch.Generator,
            device: torch.device, top_k: int = 5) -> list[str]:
    """Sample ``n_new`` tokens after each starter (top-k, special tokens banned, no KV cache needed)."""
    banned = sorted(set(getattr(tokenizer, "all_special_ids", []) or []))
    rows = [list(tokenizer(s)["input_ids"]) for s in starters]
    starts = [len(r) for r in rows]
    pad = pad_token_id(tokenizer)
    for _ in range(n_new):
        ids, lengths = right_pad(rows, pad)
        logits = logits_of(forward(ids.to(device))).float()
        last = logits[torch.arange(len(rows), device=logits.device), (lengths - 1).to(logits.device)]  # [n, vocab]
        if banned:
            last[:, banned] = float("-inf")
        top = last.topk(top_k, dim=-1)
        probs = torch.softmax(top.values, dim=-1).cpu()
        choice = torch.multinomial(probs, 1, generator=generator).squeeze(1)
        for i, row in enumerate(rows):
            row.append(int(top.indices[i, choice[i]]))
    texts = []
    for row, start, starter in zip(rows, starts, starters):
        text = starter + tokenizer.decode(row[start:], skip_special_tokens=True)
        texts.append(" ".join(text.replace("{", " ").replace("}", " ").split()))
    return texts


def generate_context_prefixes(
    pg: nn.Module,
    tokenizer: Any,
    length_params: Sequence[tuple[int, int]] = LENGTH_PARAMS,
    starters: Sequence[str] = STARTERS,
    seed: int = 0,
) -> ContextPrefixes:
    """Sample the context prefixes from the model (deterministic for a given model, seed and parameters).

    Args:
        pg: the PatchableGraph (or any ``input_ids -> logits`` model).
        tokenizer: its tokenizer.
        length_params: ``(tokens, count)`` pairs; counts are spread evenly over the starters.
        starters: first words of the continuations.
        seed: seed of a private ``torch.Generator`` (global RNG untouched).

    Returns:
        ``ContextPrefixes`` with ``""`` first, then ``"<continuation>. "`` for each sample.
    """
    generator = torch.Generator().manual_seed(seed)
    device = model_device(pg)
    forward = lambda ids: pg(ids, use_cache=False)  # noqa: E731
    prefixes = [""]
    for n_tokens, count in length_params:
        chosen = [starters[i % len(starters)] for i in range(count)]
        prefixes += [text + ". " for text in _sample(forward, tokenizer, chosen, n_tokens, generator, device)]
    return ContextPrefixes(prefixes=tuple(prefixes))


def load_or_generate_prefixes(
    pg: nn.Module,
    tokenizer: Any,
    cache_dir: str | os.PathLike[str] | None,
    fingerprint: str,
    length_params: Sequence[tuple[int, int]] = LENGTH_PARAMS,
    seed: int = 0,
) -> ContextPrefixes:
    """Context prefixes from ``cache_dir/<fingerprint>/context_templates_*.json`` (the name also holds what the
    tokenizer puts before every text: :func:`~editors.passes.start_token.start_token_tag`), generated and saved if
    absent.

    A cache file that is unreadable, not JSON, or not ``{"prefixes": [...]}`` with the empty prefix first and one
    string per sampled continuation is regenerated and replaced (atomically), with a
    :class:`~editors.errors.CacheRecomputedWarning` naming the file.

    Args:
        fingerprint: identifies the model (see :func:`editors.statistics.second_moment.statistics_fingerprint`).
        cache_dir: folder of the cache, or ``None`` to skip the disk cache.
    """
    tag = "_".join(f"{n}x{c}" for n, c in length_params) + start_token_tag(tokenizer)
    path = Path(cache_dir).expanduser() / fingerprint / f"context_templates_{tag}_seed{seed}.json" if cache_dir else None
    if path is not None and path.is_file():
        expected = 1 + sum(count for _, count in length_params)
        try:
            prefixes = json.loads(path.read_text(encoding="utf-8"))["prefixes"]
            valid = (isinstance(prefixes, list) and len(prefixes) == expected and prefixes[0] == ""
                     and all(isinstance(p, str) for p in prefixes))
            problem = f"does not hold {expected} prefix strings, the empty one first"
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as error:
            valid, problem = False, f"is unreadable ({type(error).__name__}: {error})"
        if valid:
            return ContextPrefixes(prefixes=tuple(prefixes))
        warnings.warn(f"context template cache {path} {problem}; generating the templates again and replacing it",
                      CacheRecomputedWarning, stacklevel=2)
    templates = generate_context_prefixes(pg, tokenizer, length_params=length_params, seed=seed)
    if path is not None:
        atomic_write_text(path, json.dumps({"prefixes": list(templates.prefixes)}, indent=1, ensure_ascii=False))
    return templates


def context_activations(
    pg: nn.Module,
    tokenizer: Any,
    nodes: Sequence[str],
    facts: Sequence[tuple[str, str]],
    templates: ContextPrefixes,
    patches: Mapping[str, Any] | None = None,
    max_tokens: int = 8192,
    share_prefix: bool = True,
) -> list[torch.Tensor]:
    """Activations at the subject's last token of every fact behind every context prefix, for several nodes at once.

    Each fact's prompt is filled with its subject behind each prefix. The rows behind one prefix run together
    (:func:`editors.passes.shared_prefix.row_activations`): sorted by length, in right-padded batches of at most
    ``max_tokens`` tokens (rows × width), each forward pass stopping once every node was recorded, and the tokens all
    of them begin with (the prefix's) computed once. (The first 1,000 facts of the fact bank behind six prefixes are
    121,276 tokens; in fact-major order the batches held 178,364 positions, sorted 123,969; 43 % of the tokens are
    shared prefixes.)

    Args:
        pg: the model's PatchableGraph.
        tokenizer: its tokenizer.
        nodes: NodePaths of ``[batch, seq, d]`` nodes: a layer's input node (keys, eq. 3), a residual stream.
        facts: ``F`` pairs ``(prompt template with "{}", subject)``.
        templates: the ``P`` context prefixes.
        patches: more patches for every pass (e.g. earlier layers' updates, applied as patches); with ``share_prefix``
            they must not pick positions (see :func:`editors.passes.shared_prefix.row_activations`).
        max_tokens: tokens per forward pass.
        share_prefix: compute the tokens shared by the rows behind a prefix once (off: every row runs whole; the
            activations agree up to float rounding).

    Returns:
        One ``[F, P, d]`` tensor per node (the node's dtype).

    Raises:
        SubjectNotFoundError: a fact's subject covers no token of its prompt (the message names the fact).
    """
    encoded: list[list[EncodedPrompt]] = [[] for _ in templates.prefixes]  # [prefix][fact]
    for i, (prompt, subject) in enumerate(facts):
        try:
            for j, prefix in enumerate(templates.prefixes):
                text, span = format_with_span(prompt, subject, prefix)
                encoded[j].append(encode_subject_prompt(tokenizer, text, span))
        except SubjectNotFoundError as error:
            raise SubjectNotFoundError(f"Fact {i} (subject {subject!r}, prompt {prompt!r}): {error}") from None
    pad = pad_token_id(tokenizer)
    behind: list[list[torch.Tensor]] = [[] for _ in nodes]  # per node, per prefix: [F, d]
    for rows in encoded:
        activations = row_activations(pg, nodes, [e.ids for e in rows], [e.subject_last for e in rows], pad,
                                      patches=patches, max_tokens=max_tokens, share_prefix=share_prefix)
        for part, activation in zip(behind, activations):
            part.append(activation)
    return [torch.stack(part, dim=1) for part in behind]  # [F, P, d]


def subject_first_activations(
    pg: nn.Module,
    tokenizer: Any,
    nodes: Sequence[str],
    subjects: Sequence[str],
    patches: Mapping[str, Any] | None = None,
    max_tokens: int = 8192,
) -> list[torch.Tensor]:
    """Activations at the subject's last token where a text begins with the subject: the subject alone, no prefix
    (after the tokenizer's start token, if it adds one). The model is causal, so this is the key of every prompt that
    begins with the subject, whatever follows it; the context prefixes never put a subject there.

    Args:
        pg, tokenizer, nodes, patches, max_tokens: as :func:`context_activations`.
        subjects: ``F`` subjects.

    Returns:
        One ``[F, 1, d]`` tensor per node.

    Raises:
        SubjectNotFoundError: a subject covers no token (named).
    """
    return context_activations(pg, tokenizer, nodes, [("{}", subject) for subject in subjects],
                               ContextPrefixes(prefixes=("",)), patches=patches, max_tokens=max_tokens)


def key_moments(pg: nn.Module, tokenizer: Any, layers: Sequence[LinearLayer], facts: Sequence[tuple[str, str]],
                templates: ContextPrefixes, per_context: bool, subject_first: bool, max_tokens: int = 8192
                ) -> list[torch.Tensor]:
    """``Σ k kᵀ`` ``[d_in, d_in]`` (float64, CPU) per layer over the facts' keys (all layers in one pass; an MoE
    expert's keys computed from its block's input, :meth:`editors.layers.experts.ExpertLayer.keys_of`): each fact's key
    averaged over ``templates``, or every context's (``per_context``), and with ``subject_first`` its key where a text
    begins with the subject too (:func:`subject_first_activations`): the columns a MEMIT or AlphaEdit edit solves for.

    Raises:
        SubjectNotFoundError: a fact cannot be encoded (named).
    """
    nodes = [layer.input_node for layer in layers]
    with torch.no_grad():
        keys = [layer.keys_of(k) for layer, k in zip(layers, context_activations(
            pg, tokenizer, nodes, list(facts), templates, max_tokens=max_tokens))]  # [F, P, d_in]
        columns = [k if per_context else k.mean(dim=1, keepdim=True) for k in keys]  # [F, P or 1, d_in]
        if subject_first:
            firsts = subject_first_activations(pg, tokenizer, nodes, [subject for _, subject in facts],
                                               max_tokens=max_tokens)  # [F, 1, d] per node
            columns = [torch.cat([k, layer.keys_of(f)], dim=1) for layer, k, f in zip(layers, columns, firsts)]
    flat = [k.reshape(-1, k.shape[-1]).to(torch.float64).cpu() for k in columns]  # [F · columns, d_in]
    return [k.T @ k for k in flat]


def compute_key(
    pg: nn.Module,
    tokenizer: Any,
    layer: LinearLayer,
    prompt: str,
    subject: str,
    templates: ContextPrefixes,
) -> torch.Tensor:
    """``k*``: the layer input at the subject's last token, averaged over the context prefixes (eq. 3).

    Args:
        pg: the model's PatchableGraph.
        tokenizer: its tokenizer.
        layer: the edited layer.
        prompt: template with ``"{}"`` for the subject.
        subject: the subject.
        templates: the context prefixes.

    Returns:
        ``k*`` ``[d_in]`` (the layer's dtype).
    """
    keys = context_activations(pg, tokenizer, [layer.input_node], [(prompt, subject)], templates)[0]  # [1, P, d_in]
    return keys[0].mean(dim=0)
