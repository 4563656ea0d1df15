"""The noise scale σ of causal tracing: over the embedding matrix, or over the embeddings of a list of texts."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from gradpatch import NodePathError, PatchableGraph
from gradpatch.model_io import model_device

from ..errors import TraceError
from .paths import ModelPaths, detect_model_paths

__all__ = ["corpus_embedding_std", "embedding_matrix_std"]


def _embedding_module(pg: PatchableGraph, paths: ModelPaths, fix: str = "") -> nn.Module:
    """The input-embedding module at ``paths.embed_module``.

    Raises:
        TraceError: there is none (the message names ``fix`` and ``paths=ModelPaths(embed=...)``).
    """
    try:
        return pg.original_module(paths.embed_module)
    except (NodePathError, ValueError) as error:
        raise TraceError(f"Cannot find the embedding module {paths.embed_module!r} ({error}); pass "
                         f"{fix}paths=ModelPaths(embed=...)") from error


def embedding_matrix_std(pg: PatchableGraph, paths: ModelPaths | None = None) -> float:
    """Standard deviation of all entries of the input-embedding matrix ``[vocab, d_model]`` (dimensionless).

    Args:
        pg: the PatchableGraph of the model.
        paths: NodePaths (auto-detected when ``None``).

    Raises:
        TraceError: the embedding module is not found or has no ``weight`` matrix (pass ``noise_std=`` to
            :func:`~editors.causal_trace.causal_trace`).
    """
    paths = paths or detect_model_paths(pg)
    module = _embedding_module(pg, paths, fix="noise_std= explicitly or ")
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise TraceError(
            f"The embedding module {paths.embed_module!r} has no 2-D weight matrix: pass noise_std= explicitly "
            f"(e.g. from corpus_embedding_std)"
        )
    return float(weight.detach().float().std())


def corpus_embedding_std(
    pg: PatchableGraph, tokenizer: Any, texts: Iterable[str], paths: ModelPaths | None = None
) -> float:
    """Standard deviation of the embeddings of the tokens of ``texts`` (all entries pooled; dimensionless).

    The paper's code measures the noise scale this way over the subjects of its known-facts dataset. Special
    tokens the tokenizer adds (BOS) are left out. The embedding module (``paths.embed`` without ``.output``) is
    called directly on the token ids: token embeddings do not depend on context, so no forward pass is needed.

    Args:
        pg: the PatchableGraph of the model.
        tokenizer: its tokenizer.
        texts: e.g. a list of subjects ``["The Eiffel Tower", "Barack Obama", ...]``.
        paths: NodePaths (auto-detected when ``None``).

    Returns:
        σ over all embedding entries of all tokens.

    Raises:
        TraceError: ``texts`` holds no token, or the embedding module is not found.
    """
    module = _embedding_module(pg, paths or detect_model_paths(pg))
    device = model_device(module)
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    chunks: list[torch.Tensor] = []
    with torch.no_grad():
        for text in texts:
            ids = [t for t in tokenizer(text)["input_ids"] if t not in special]
            if ids:  # embeddings do not depend on context: embed the tokens alone
                chunks.append(module(torch.tensor([ids], device=device)).float().reshape(-1).cpu())
    if not chunks:
        raise TraceError("corpus_embedding_std got no tokens: give a non-empty list of texts")
    return float(torch.cat(chunks).std())
