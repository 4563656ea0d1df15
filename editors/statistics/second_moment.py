"""Second moment ``C = E[k kᵀ]`` of a linear layer's input over a text corpus, streamed and cached.

ROME's update (eq. 2) weighs the change of ``W`` by ``C⁻¹`` so that keys typical of the corpus are disturbed
least. ``C`` is the uncentred second moment of the layer input over every (non-special) token of the corpus
documents, accumulated in float64 batch by batch (``C = Σ Kᵀ K / n_tokens`` with ``K`` ``[tokens, d_in]``;
:mod:`editors.statistics.sums`). One expert of an MoE block weighs the tokens routed to it
(:mod:`editors.layers.experts`).

Results are cached as safetensors files under ``~/.cache/gradpatch/stats`` (override with ``cache_dir=`` or the
``GRADPATCH_STATS_DIR`` environment variable), keyed by a fingerprint of the model (that leaves out the edited
layer's own weight, which does not influence its input, so the statistics survive edits of that layer), the
NodePath, the corpus name, the number of documents, the truncation length and the start token the tokenizer puts
before every text. A cache file is written atomically (temporary file + rename) and checked when read — readable,
the expected key and shape, the dtype its name gives, finite, symmetric, metadata matching the layer; one that fails a
check is recomputed (and replaced) with a :class:`~editors.errors.CacheRecomputedWarning` naming the file and the
problem.
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save as save_safetensors
from torch import nn

from gradpatch import model_fingerprint
from gradpatch.files.atomic import atomic_write_bytes
from gradpatch.files.cache import cache_folder
from gradpatch.model_io import wrapped_model
from gradpatch.progress import ProgressBar

from ..defaults import DEFAULT_MAX_LENGTH, DEFAULT_N_SAMPLES
from ..errors import CacheRecomputedWarning
from ..layers import LinearLayer, resolve_layer
from ..passes.start_token import start_token_tag
from .corpus import Corpus, open_corpus
from .sums import SecondMomentSums

__all__ = ["SecondMoment", "SecondMomentSums", "compute_second_moment", "compute_second_moments", "default_cache_dir",
           "layer_second_moment", "layer_second_moments", "save_second_moment", "second_moment_cache_file",
           "statistics_fingerprint"]


def default_cache_dir() -> Path:
    """``$GRADPATCH_STATS_DIR`` if set, else ``~/.cache/gradpatch/stats``."""
    return cache_folder("GRADPATCH_STATS_DIR", "stats")


@dataclass
class SecondMoment:
    """The statistics of one layer input.

    Attributes:
        matrix: ``C`` ``[d_in, d_in]`` float64 (mean of ``k kᵀ`` over tokens).
        n_tokens: tokens accumulated.
        n_samples: documents read.
        input_node: NodePath of the layer input, e.g. ``model.layers_4.mlp.down_proj.input`` (an
            :class:`~editors.edits.Edit`'s ``node`` is the layer itself, ``model.layers_4.mlp.down_proj``); for one
            expert of an MoE block, its slice's name plus ``.input`` (``model.layers_4.mlp.experts.down_proj[2].input``:
            the keys it computes, over the tokens routed to it, :mod:`editors.layers.experts`).
        fingerprint: model fingerprint (edited layer left out) the statistics belong to.
        corpus: corpus name (``None`` for an anonymous iterable).
    """

    matrix: torch.Tensor
    n_tokens: int
    n_samples: int
    input_node: str
    fingerprint: str
    corpus: str | None


def statistics_fingerprint(model: nn.Module, skip: tuple[str, ...] = ()) -> str:
    """:func:`gradpatch.model_fingerprint` of the model with the parameters under ``skip`` left out.

    Args:
        model: the model (a PatchableGraph is unwrapped).
        skip: module NodePaths / dotted prefixes whose parameters are left out (the edited layer), or parameter
            NodePaths (a fused MoE experts weight, ``model.layers_3.mlp.experts.down_proj``, or one expert's slice
            of it, ``...down_proj[2]``: the whole fused parameter is left out).

    Returns:
        16 hex digits.
    """
    prefixes = [_torch_path(re.sub(r"\[-?\d+\]$", "", s)) for s in skip]  # an expert's slice: its fused weight
    names = {name for name, _ in wrapped_model(model).named_parameters()}
    return model_fingerprint(wrapped_model(model), skip=tuple(p if p in names else p + "." for p in prefixes))


def _torch_path(node_path: str) -> str:
    """``model.layers_4.mlp`` -> ``model.layers.4.mlp`` (NodePath to ``named_parameters`` names)."""
    return re.sub(r"_(\d+)(?=\.|$)", r".\1", node_path)


def second_moment_cache_file(cache_dir: Path, fingerprint: str, node: str, corpus: str, n_samples: int,
                             max_length: int, dtype: torch.dtype = torch.float64, start: str = "") -> Path:
    """Where the statistics of ``node`` are cached: ``cache_dir/fingerprint/NODE__CORPUS__nN__lenL[START]__DTYPE
    .safetensors`` (the key: model fingerprint without the edited layer, NodePath, corpus name, documents, truncation
    length, ``start`` = :func:`editors.passes.start_token.start_token_tag` of the tokenizer, accumulation dtype)."""
    safe_corpus = re.sub(r"[^A-Za-z0-9_.-]", "_", corpus)
    name = f"{node}__{safe_corpus}__n{n_samples}__len{max_length}{start}__{str(dtype).replace('torch.', '')}"
    return cache_dir / fingerprint / f"{name}.safetensors"


def save_second_moment(path: Path, moment: SecondMoment, n_samples: int, max_length: int,
                       dtype: torch.dtype = torch.float64) -> Path:
    """Write ``moment`` to the cache file ``path`` (:func:`second_moment_cache_file`) atomically, in the format
    :func:`layer_second_moments` reads: tensor ``second_moment`` ``[d_in, d_in]`` in ``dtype`` plus metadata.

    Raises:
        OSError: the folder cannot be written.
    """
    data = save_safetensors(
        {"second_moment": moment.matrix.to(dtype).cpu().contiguous()},
        metadata={"node": moment.input_node, "fingerprint": moment.fingerprint, "corpus": str(moment.corpus),
                  "n_samples": str(n_samples), "n_documents": str(moment.n_samples),
                  "n_tokens": str(moment.n_tokens), "max_length": str(max_length)},
    )
    return atomic_write_bytes(path, data)


def compute_second_moments(
    pg: nn.Module,
    tokenizer: Any,
    layers: Sequence[LinearLayer],
    corpus: Corpus,
    n_samples: int = DEFAULT_N_SAMPLES,
    max_length: int = DEFAULT_MAX_LENGTH,
    batch_size: int = 16,
    accumulate_dtype: torch.dtype = torch.float64,
    progress: bool = True,
) -> tuple[list[torch.Tensor], int, int]:
    """Stream ``n_samples`` documents through the model once and accumulate ``Σ k kᵀ`` at every layer's input.

    Documents are truncated to ``max_length`` tokens, grouped by length (fewer pads) and right-padded; pad
    positions and special tokens (BOS/EOS) are left out. Each forward pass stops once the last of the layers'
    inputs is recorded, so statistics for layers 2 to 6 cost one pass to layer 6, not five.

    Args:
        pg: the model's :class:`gradpatch.PatchableGraph`.
        tokenizer: its tokenizer.
        layers: the edited layers.
        corpus: the documents.
        n_samples: documents to read (fewer if the corpus is shorter).
        max_length: truncation length in tokens.
        batch_size: documents per forward pass.
        accumulate_dtype: float64 (default) or float32.
        progress: show a progress bar (:class:`gradpatch.progress.ProgressBar`).

    Returns:
        ``([C [d_in, d_in] float64 per layer], n_tokens, n_documents)``.

    Raises:
        StatisticsError: the corpus yields no token.
    """
    sums = SecondMomentSums(pg, tokenizer, layers, accumulate_dtype)
    n_docs = 0
    nodes = [layer.input_node for layer in layers]
    what = nodes[0] if len(nodes) == 1 else f"{len(nodes)} layers"
    bar = ProgressBar(f"second moment {what}", unit="doc", total=n_samples, enabled=progress)
    group: list[list[int]] = []

    def flush(docs: list[list[int]]) -> None:
        docs = sorted(docs, key=len)
        for i in range(0, len(docs), batch_size):
            chunk = docs[i : i + batch_size]
            sums.add(chunk)
            bar.advance(len(chunk))

    try:
        for text in corpus:
            if n_docs >= n_samples:
                break
            ids = list(tokenizer(text, truncation=True, max_length=max_length)["input_ids"])
            n_docs += 1
            if ids:
                group.append(ids)
            if len(group) >= 8 * batch_size:
                flush(group)
                group = []
        if group:
            flush(group)
    finally:
        bar.close()
    return sums.means(), sums.n_tokens, n_docs


def compute_second_moment(
    pg: nn.Module,
    tokenizer: Any,
    layer: LinearLayer,
    corpus: Corpus,
    n_samples: int = DEFAULT_N_SAMPLES,
    max_length: int = DEFAULT_MAX_LENGTH,
    batch_size: int = 16,
    accumulate_dtype: torch.dtype = torch.float64,
    progress: bool = True,
) -> tuple[torch.Tensor, int, int]:
    """:func:`compute_second_moments` for one layer: ``(C [d_in, d_in] float64, n_tokens, n_documents)``.

    Raises:
        StatisticsError: the corpus yields no token.
    """
    matrices, n_tokens, n_docs = compute_second_moments(pg, tokenizer, [layer], corpus, n_samples=n_samples,
                                                        max_length=max_length, batch_size=batch_size,
                                                        accumulate_dtype=accumulate_dtype, progress=progress)
    return matrices[0], n_tokens, n_docs


def layer_second_moments(
    pg: nn.Module,
    tokenizer: Any,
    nodes: Sequence[str | LinearLayer],
    corpus: Corpus | str | os.PathLike[str] | Any | None = None,
    n_samples: int = DEFAULT_N_SAMPLES,
    max_length: int = DEFAULT_MAX_LENGTH,
    batch_size: int = 16,
    cache_dir: str | os.PathLike[str] | None = None,
    use_cache: bool = True,
    accumulate_dtype: torch.dtype = torch.float64,
    progress: bool = True,
) -> list[SecondMoment]:
    """``C = E[k kᵀ]`` at several layers' inputs: each read from the cache, the missing ones computed in one pass
    over the corpus (:func:`compute_second_moments`) and cached one file per layer.

    Args:
        pg: the model's :class:`gradpatch.PatchableGraph`.
        tokenizer: its tokenizer.
        nodes: NodePaths of the edited layers (or resolved :class:`LinearLayer` objects).
        corpus: ``None`` (Wikipedia summaries), a file path, an iterable of strings or a :class:`Corpus`.
            Anonymous iterables are not cached unless given as ``Corpus(name=..., texts=...)``.
        n_samples: documents to read.
        max_length: truncation length in tokens.
        batch_size: documents per forward pass.
        cache_dir: cache folder (default :func:`default_cache_dir`).
        use_cache: read and write the cache.
        accumulate_dtype: float64 (default) or float32 accumulation.
        progress: show a progress bar while computing.

    Returns:
        One :class:`SecondMoment` per node, in order.

    Raises:
        KeyError, LayerKindError: a NodePath is not a linear layer of the graph.
        StatisticsError: the corpus yields no token.
    """
    layers = [resolve_layer(pg, node) if isinstance(node, str) else node for node in nodes]
    source = open_corpus(corpus)
    results: list[SecondMoment | None] = [None] * len(layers)
    paths: list[Path | None] = [None] * len(layers)
    fingerprints = [statistics_fingerprint(pg, skip=(layer.path,)) for layer in layers]
    for i, layer in enumerate(layers):
        if not use_cache or source.name is None:
            continue
        folder = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
        paths[i] = second_moment_cache_file(folder, fingerprints[i], layer.statistics_node, source.name, n_samples,
                                            max_length, accumulate_dtype, start=start_token_tag(tokenizer))
        cached = _read_cache(paths[i], layer, fingerprints[i], accumulate_dtype) if paths[i].is_file() else None
        if cached is not None:
            matrix, n_tokens, n_docs = cached
            results[i] = SecondMoment(matrix=matrix.to(layer.device), n_tokens=n_tokens, n_samples=n_docs,
                                      input_node=layer.statistics_node, fingerprint=fingerprints[i], corpus=source.name)
    missing = [i for i, result in enumerate(results) if result is None]
    if missing:
        matrices, n_tokens, n_docs = compute_second_moments(
            pg, tokenizer, [layers[i] for i in missing], source, n_samples=n_samples, max_length=max_length,
            batch_size=batch_size, accumulate_dtype=accumulate_dtype, progress=progress,
        )
        for i, matrix in zip(missing, matrices):
            layer, path = layers[i], paths[i]
            moment = SecondMoment(matrix=matrix, n_tokens=n_tokens, n_samples=n_docs, input_node=layer.statistics_node,
                                  fingerprint=fingerprints[i], corpus=source.name)
            if path is not None:
                # Stored in the accumulation dtype the file name gives (float32 accumulation loses nothing by it).
                save_second_moment(path, moment, n_samples, max_length, accumulate_dtype)
            results[i] = moment
    return [result for result in results if result is not None]


def layer_second_moment(
    pg: nn.Module,
    tokenizer: Any,
    node: str | LinearLayer,
    corpus: Corpus | str | os.PathLike[str] | Any | None = None,
    n_samples: int = DEFAULT_N_SAMPLES,
    max_length: int = DEFAULT_MAX_LENGTH,
    batch_size: int = 16,
    cache_dir: str | os.PathLike[str] | None = None,
    use_cache: bool = True,
    accumulate_dtype: torch.dtype = torch.float64,
    progress: bool = True,
) -> SecondMoment:
    """``C = E[k kᵀ]`` at a layer's input, read from the cache or computed and cached
    (:func:`layer_second_moments` for one layer; the arguments are the same).

    Returns:
        A :class:`SecondMoment`.
    """
    return layer_second_moments(pg, tokenizer, [node], corpus=corpus, n_samples=n_samples, max_length=max_length,
                                batch_size=batch_size, cache_dir=cache_dir, use_cache=use_cache,
                                accumulate_dtype=accumulate_dtype, progress=progress)[0]


def _read_cache(path: Path, layer: LinearLayer, fingerprint: str,
                dtype: torch.dtype) -> tuple[torch.Tensor, int, int] | None:
    """``(C [d_in, d_in] float64 on the CPU, n_tokens, n_documents)`` from a cache file, or ``None`` (with a
    :class:`CacheRecomputedWarning` naming the file and the problem) when the file is unreadable or inconsistent."""
    try:
        with safe_open(str(path), framework="pt") as handle:
            meta = handle.metadata() or {}
            keys = set(handle.keys())
            matrix = handle.get_tensor("second_moment") if "second_moment" in keys else None
        n_tokens, n_docs = int(meta["n_tokens"]), int(meta["n_documents"])
    except (SafetensorError, OSError, KeyError, ValueError) as error:
        return _recompute(path, f"unreadable or incomplete ({type(error).__name__}: {error})")
    if matrix is None:
        return _recompute(path, "holds no 'second_moment' tensor")
    if (meta.get("node"), meta.get("fingerprint")) != (layer.statistics_node, fingerprint):
        return _recompute(path, f"belongs to {meta.get('node')!r} of model {meta.get('fingerprint')!r}")
    if matrix.shape != (layer.d_in, layer.d_in) or matrix.dtype != dtype:
        return _recompute(path, f"holds a {matrix.dtype} matrix of shape {list(matrix.shape)}, not {dtype} "
                                f"[{layer.d_in}, {layer.d_in}] as its name says")
    if not bool(torch.isfinite(matrix).all()):
        return _recompute(path, "holds NaN or inf")
    asymmetry, scale = float((matrix - matrix.T).abs().max()), float(matrix.abs().max())
    if asymmetry > 1e-5 * scale or n_tokens < 1:
        return _recompute(path, f"is not a second moment (asymmetry {asymmetry:.3g}, scale {scale:.3g}, "
                                f"{n_tokens} tokens)")
    return matrix.to(torch.float64), n_tokens, n_docs


def _recompute(path: Path, problem: str) -> None:
    warnings.warn(f"statistics cache {path} {problem}; recomputing the second moment and replacing the file",
                  CacheRecomputedWarning, stacklevel=4)
    return None
