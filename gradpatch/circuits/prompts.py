"""The prompt as circuit-tracer 0.5.0 attributes it: a special token first (its ``ensure_tokenized``), so that
position 0, whose nodes the graph leaves out (``attribute``'s ``zero_first_position``), is that token and not a word
of the prompt."""

from __future__ import annotations

import torch

__all__ = ["with_special_first"]


def with_special_first(ids: torch.Tensor, tokenizer: object) -> torch.Tensor:
    """``ids`` ``[1, seq]`` with a special token prepended where the first is not one (circuit-tracer 0.5.0's
    ``ensure_tokenized``: the tokenizer's BOS, else pad, EOS or its first special token; none: ``ids`` as they
    are)."""
    special = list(tokenizer.all_special_ids)  # type: ignore[attr-defined]
    if int(ids[0, 0]) in special:
        return ids
    candidates = [getattr(tokenizer, f"{name}_token_id") for name in ("bos", "pad", "eos")] + special
    first = next((token for token in candidates if token is not None), None)
    if first is None:
        return ids
    return torch.cat([torch.full((1, 1), int(first), dtype=ids.dtype, device=ids.device), ids], 1)
