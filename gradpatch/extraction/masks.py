"""The one adjustment extraction makes to transformers' own code: attention-mask decisions taken as in eager mode."""

from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from .tracer import ValueProxy, depends_on_input_values


@contextmanager
def eager_mask_decisions() -> Iterator[None]:
    """While extracting, let transformers build attention masks as it does in eager mode when the positions are
    the ones the model derived from the input sizes.

    Under a tracer, transformers' ``find_packed_sequence_indices`` cannot test whether the position ids hold
    several packed sequences (a decision on tensor values), so it keeps a general mask: the graph would then
    build a full ``[batch, 1, seq, seq]`` mask and call attention with it, where eager mode calls SDPA with
    ``is_causal=True`` (flash attention, no repeated key/value heads). Positions computed inside the model from
    sizes alone (``cache_position.unsqueeze(0)``, an ``arange``) are one contiguous sequence per row for every
    size, which is eager mode's answer too: for those, this returns ``None`` ("not packed") without looking.
    Position ids that came from the caller keep transformers' general mask.
    """
    masking = sys.modules.get("transformers.masking_utils")
    original: Callable[[Any], Any] | None = getattr(masking, "find_packed_sequence_indices", None)
    if original is None:
        yield
        return

    def find_packed_sequence_indices(position_ids: Any) -> Any:
        if isinstance(position_ids, ValueProxy) and not depends_on_input_values(position_ids.node):
            return None
        return original(position_ids)

    masking.find_packed_sequence_indices = find_packed_sequence_indices  # type: ignore[union-attr]
    try:
        yield
    finally:
        masking.find_packed_sequence_indices = original  # type: ignore[union-attr]
