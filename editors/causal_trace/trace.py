"""Causal tracing of one prompt (Meng et al. 2022, arXiv 2202.05262, section 2.1): :func:`causal_trace`."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import torch

from gradpatch import AddPatch, CustomPatch, PatchableGraph, ProbePatch, ReplacePatch
from gradpatch.layouts import logits_input
from gradpatch.model_io import logits_of, model_device

from ..errors import TokenizationError, TraceError
from ..passes.tokens import encode_prompt_target, prompt_and_span, subject_token_range
from .config import KINDS, TraceConfig
from .noise import embedding_matrix_std
from .paths import ModelPaths, checked_paths, count_layers, detect_model_paths, layer_window, tensor_width
from .result import KindTrace, TraceResult

__all__ = ["causal_trace"]


def _checked(config: TraceConfig | None, options: dict[str, Any]) -> TraceConfig:
    """``config`` (default :class:`TraceConfig`) with ``options`` replacing its fields, checked.

    Raises:
        TraceError: an option that is not a field, an unknown kind, no kinds, ``samples < 1``, a window below 1 or
            ``batch_size < 2``.
    """
    fields = {f.name for f in dataclasses.fields(TraceConfig)}
    unknown = sorted(set(options) - fields)
    if unknown:
        raise TraceError(f"Unknown causal_trace option(s) {', '.join(unknown)}: the options are the fields of "
                         f"TraceConfig ({', '.join(sorted(fields))})")
    config = dataclasses.replace(config or TraceConfig(), **options)
    config = dataclasses.replace(config, kinds=tuple(config.kinds), windows=dict(config.windows or {}))
    for kind in config.kinds:
        if kind not in KINDS:
            raise TraceError(f"Unknown kind {kind!r}: choose among {', '.join(KINDS)}")
    if not config.kinds:
        raise TraceError(f"No kinds to trace: give some of {', '.join(KINDS)}")
    if config.samples < 1:
        raise TraceError(f"samples must be at least 1, got {config.samples}")
    if config.batch_size < 2:
        raise TraceError(f"batch_size must be at least 2 rows, got {config.batch_size}")
    for kind in config.kinds:
        if config.window(kind) < 1:
            raise TraceError(f"The window of {kind!r} must be at least 1 layer, got {config.window(kind)}")
    return config


def _answer_id(tokenizer: Any, text: str, ids: list[int], answer: str | int) -> int:
    """The first token id of ``answer`` as a continuation of ``text`` (a given token id passes through).

    Raises:
        TokenizationError: the answer is empty or does not tokenize as a continuation of the prompt.
    """
    if isinstance(answer, int):
        return answer
    encoded = encode_prompt_target(tokenizer, text, answer)
    if encoded.ids[: encoded.target_start] != ids:
        raise TokenizationError(
            f"The tokens of {text!r} change when {answer!r} follows it: end the prompt at a word boundary, or "
            f"give the answer as a token id"
        )
    return encoded.ids[encoded.target_start]


def _keep_last_position(hidden: torch.Tensor) -> torch.Tensor:
    """``[batch, seq, d_model] -> [batch, 1, d_model]``: the only position whose logits causal tracing reads."""
    return hidden[:, -1:]


def _last_logits(pg: PatchableGraph, ids: torch.Tensor, patch_map: dict[str, Any], cut: str | None) -> torch.Tensor:
    """Logits ``[batch, vocab]`` at the last position of ``ids`` ``[batch, seq]`` under ``patch_map``.

    ``cut`` is the unembedding's input NodePath (or ``None``): there the sequence is cut to its last position.
    """
    if cut is not None:
        patch_map = {**patch_map, cut: CustomPatch(custom_op=_keep_last_position)}
    with pg.patch(patch_map):
        logits = logits_of(pg(ids, use_cache=False))
    return logits[:, -1, :].float()


def causal_trace(
    pg: PatchableGraph,
    tokenizer: Any,
    prompt: str,
    subject: str,
    *,
    answer: str | int | None = None,
    config: TraceConfig | None = None,
    paths: ModelPaths | None = None,
    progress: Callable[[int, int], None] | None = None,
    **options: Any,
) -> TraceResult:
    """Trace which states of ``pg``'s model carry the fact ``prompt(subject) -> answer`` (paper section 2.1).

    Args:
        pg: PatchableGraph of a causal LM; build it with a batch-2 example (``ids.expand(2, -1)``) so that no
            forward pass here needs a re-extraction.
        tokenizer: the model's tokenizer (fast tokenizers give character offsets; slow ones work too).
        prompt: the prompt with ``"{}"`` where the subject goes (``"{} is located in the city of"``), or the full
            text containing the subject (its last occurrence is corrupted).
        subject: the subject whose token embeddings are corrupted (``"The Eiffel Tower"``).
        answer: the answer text (its first token is scored, e.g. ``"Paris"`` for ``" Paris"``) or a token id;
            ``None`` uses the clean greedy prediction.
        config: the settings (:class:`TraceConfig`: kinds, samples, noise, seed, windows, batch size, causal);
            default ``TraceConfig()``, the paper's.
        paths: the model's NodePaths (default: detected among :data:`LLAMA_PATHS` and :data:`GPT2_PATHS`).
        progress: optional callback ``(rows_done, rows_total)`` after each forward pass.
        **options: fields of :class:`TraceConfig` replacing ``config``'s, e.g. ``samples=3, kinds=["mlp"]``.

    Returns:
        A :class:`TraceResult` with ``kinds[kind].scores`` ``[num_layers, num_tokens]``.

    Raises:
        SubjectNotFoundError: the subject is not in the prompt (or the template has no single ``"{}"``).
        TokenizationError: the answer does not tokenize as a continuation of the prompt.
        TraceError: an unknown option or kind, ``samples < 1``, a window below 1, ``batch_size < 2``, ``pg`` in
            training mode, or NodePaths that do not fit the model (the message says to pass
            ``paths=ModelPaths(...)``).
    """
    t_start = time.perf_counter()
    config = _checked(config, options)
    kinds = list(config.kinds)
    samples = config.samples
    if pg.training:
        raise TraceError("The model is in training mode (dropout would add its own noise): call pg.eval() first")
    paths = paths or detect_model_paths(pg)
    num_layers = count_layers(pg, paths)
    d_model = tensor_width(pg, paths.embed, "embedding")
    for kind in kinds:
        tensor_width(pg, paths.path(kind, 0), kind)
    paths = checked_paths(pg, paths)

    text, span = prompt_and_span(prompt, subject)
    ids_list, (s0, s1) = subject_token_range(tokenizer, text, span)
    num_tokens = len(ids_list)
    cut = logits_input(pg, paths)
    device = model_device(pg)

    if config.noise_std is None:
        noise_std, source = embedding_matrix_std(pg, paths), "embedding_matrix"
    else:
        noise_std, source = config.noise_std, config.noise_std_source or "given"
    generator = torch.Generator().manual_seed(config.seed)
    noise = torch.randn(samples, s1 - s0, d_model, generator=generator) * (config.noise_level * noise_std)
    noise = noise.to(device)

    # Clean run (row 0, no noise) and corrupted baseline (rows 1..samples) in one pass, probing every state.
    ids = torch.tensor(ids_list, device=device)
    batch = ids.expand(samples + 1, -1)
    noise_rows = torch.cat([torch.zeros_like(noise[:1]), noise])
    probes: dict[str, ProbePatch] = {paths.path(k, layer): ProbePatch() for k in kinds for layer in range(num_layers)}
    patch_map: dict[str, Any] = {paths.embed: AddPatch(value=noise_rows, slice=(slice(None), slice(s0, s1)))}
    patch_map.update(probes)
    with torch.no_grad():
        probs = torch.softmax(_last_logits(pg, batch, patch_map, cut), dim=-1)
        answer_id = int(probs[0].argmax()) if answer is None else _answer_id(tokenizer, text, ids_list, answer)
        if not 0 <= answer_id < probs.shape[-1]:
            raise TokenizationError(f"Answer token id {answer_id} is outside the vocabulary of {probs.shape[-1]}")
        clean_prob = float(probs[0, answer_id])
        corrupted_prob = float(probs[1:, answer_id].mean())
        clean = {path: probe.activation[0] for path, probe in probes.items()}  # each [seq, d_model]
    del probes, patch_map

    # Restoration rows: (kind, layer, token) jobs x noise samples, cut into batches of at most batch_size rows.
    first_token = s0 if config.causal else 0
    jobs = [(kind, layer, tok)
            for kind in kinds for layer in range(num_layers) for tok in range(first_token, num_tokens)]
    rows_total = len(jobs) * samples
    row_probs = torch.empty(rows_total)
    row_job = torch.arange(len(jobs)).repeat_interleave(samples)
    row_sample = torch.arange(samples).repeat(len(jobs))
    with torch.no_grad():
        for begin in range(0, rows_total, config.batch_size):
            end = min(begin + config.batch_size, rows_total)
            chunk_jobs, chunk_samples = row_job[begin:end].tolist(), row_sample[begin:end]
            if end - begin == 1:  # never run batch 1: a batch-2 example's graphs cover batches >= 2 only
                chunk_jobs, chunk_samples = chunk_jobs * 2, chunk_samples.repeat(2)
            restore: dict[str, tuple[list[int], list[int]]] = {}
            for row, job in enumerate(chunk_jobs):
                kind, center, tok = jobs[job]
                for layer in layer_window(center, config.window(kind), num_layers):
                    rows, toks = restore.setdefault(paths.path(kind, layer), ([], []))
                    rows.append(row)
                    toks.append(tok)
            chunk_map: dict[str, Any] = {
                paths.embed: AddPatch(value=noise[chunk_samples.to(device)], slice=(slice(None), slice(s0, s1)))
            }
            for path, (rows, toks) in restore.items():
                index = (torch.tensor(rows, device=device), torch.tensor(toks, device=device))
                chunk_map[path] = ReplacePatch(value=clean[path][index[1]], slice=index)
            logits = _last_logits(pg, ids.expand(len(chunk_jobs), -1), chunk_map, cut)
            result = torch.softmax(logits, dim=-1)[:, answer_id].cpu()
            row_probs[begin:end] = result[: end - begin]
            if progress is not None:
                progress(end, rows_total)

    job_means = row_probs.view(len(jobs), samples).mean(dim=1) if jobs else row_probs
    traces: dict[str, KindTrace] = {}
    for kind in kinds:
        scores = torch.full((num_layers, num_tokens), corrupted_prob)
        pattern = f"{paths.layer}.{getattr(paths, kind)}"
        traces[kind] = KindTrace(kind=kind, window=config.window(kind), node_pattern=pattern, scores=scores)
    for job, (kind, layer, tok) in enumerate(jobs):
        traces[kind].scores[layer, tok] = job_means[job]

    tokens = [tokenizer.decode([t]) for t in ids_list]
    return TraceResult(
        prompt=text, subject=subject, tokens=tokens, token_ids=ids_list, subject_range=(s0, s1),
        answer=tokenizer.decode([answer_id]), answer_id=answer_id, clean_prob=clean_prob,
        corrupted_prob=corrupted_prob, noise_std=float(noise_std), noise_std_source=source,
        noise_level=float(config.noise_level), samples=samples, seed=config.seed, num_layers=num_layers,
        paths=paths, kinds=traces, seconds=time.perf_counter() - t_start,
    )
