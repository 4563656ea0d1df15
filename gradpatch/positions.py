"""Token positions for patches: which tokens of the current forward pass a patch touches.

A patch's ``slice`` indexes the tokens of the *current* forward pass (graphpatch's meaning): with a KV cache,
``pg.generate`` runs the prompt once (prefill) and then one forward pass per new token, so
``AddPatch(value=v, slice=(slice(None), -1))`` patches the last prompt token, then each new token once, and what it
changed stays in the cache. :class:`Tokens` instead names positions in the whole sequence — absolute positions, the
``"prompt"`` or the ``"generated"`` tokens — and resolves them in each forward pass, so a patch touches the same
tokens whether the sequence is computed at once or step by step::

    with pg.patch({"model.layers_5.output": AddPatch(value=steering, slice=Tokens("generated"))}):
        pg.generate(ids, max_new_tokens=64)           # steers the new tokens only, cached or not

Outside :meth:`~gradpatch.PatchableGraph.generate`, a forward pass starts at position 0 and every token counts as
prompt.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Iterator, Union

import torch

#: Which positions: ``"prompt"``, ``"generated"``, ``"all"``, absolute positions (an int, a list or ``range``) or
#: an absolute slice (``slice(-3, None)``: the last three of the whole sequence so far).
Selection = Union[str, int, Sequence[int], slice]


@dataclass(frozen=True)
class Window:
    """Where the current forward pass sits in the sequence.

    Attributes:
        offset: absolute position of its first token (the length of the KV cache before it).
        prompt_length: number of prompt tokens, ``None`` outside generation (every token is prompt).
    """

    offset: int = 0
    prompt_length: int | None = None


_WINDOW: ContextVar[Window] = ContextVar("gradpatch_token_window", default=Window())


@contextmanager
def token_window(window: Window) -> Iterator[None]:
    """Set the window of the forward passes run inside the block (:meth:`PatchableGraph.generate` does)."""
    token = _WINDOW.set(window)
    try:
        yield
    finally:
        _WINDOW.reset(token)


@dataclass(frozen=True)
class Tokens:
    """A patch ``slice`` naming positions in the whole sequence, resolved in each forward pass.

    Attributes:
        select: ``"prompt"``, ``"generated"``, ``"all"``, absolute positions (int, list, ``range``) or an absolute
            ``slice``.
        dim: the token dimension of the patched value: 1 for ``[batch, seq, ...]`` (residual stream, MLP), 2 for
            ``[batch, heads, seq, head_dim]`` (attention's queries, keys and values).

    Raises:
        ValueError: at construction, for a string other than the three names, or ``dim`` < 0.
    """

    select: Selection = "all"
    dim: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.select, str) and self.select not in ("prompt", "generated", "all"):
            raise ValueError(f"Tokens({self.select!r}): use 'prompt', 'generated', 'all', positions or a slice")
        if self.dim < 0:
            raise ValueError(f"Tokens(dim={self.dim}): give the token dimension counted from the front, e.g. 1")

    def index(self, value: torch.Tensor) -> tuple[Any, ...] | None:
        """The index into ``value`` of the selected positions present in this forward pass, ``None`` if none is.

        Raises:
            IndexError: ``value`` has no dimension ``dim``.
        """
        if value.dim() <= self.dim:
            raise IndexError(f"Tokens(dim={self.dim}) on a value of shape {tuple(value.shape)}: give the token "
                             f"dimension with dim=")
        window = _WINDOW.get()
        length = value.shape[self.dim]
        start, stop = window.offset, window.offset + length
        prompt = stop if window.prompt_length is None else window.prompt_length
        select = self.select
        if select == "all":
            local: Any = slice(None)
        elif select in ("prompt", "generated") or (isinstance(select, slice) and select.step in (None, 1)):
            if isinstance(select, slice):  # a contiguous range: indexed as a view, not a gathered copy
                span = range(*select.indices(stop))
                low, high = span.start, span.stop
            else:
                low, high = (0, prompt) if select == "prompt" else (prompt, stop)
            low, high = max(low, start) - start, min(high, stop) - start
            if low >= high:
                return None
            local = slice(low, high)
        else:
            positions = range(*select.indices(stop)) if isinstance(select, slice) else (
                [select] if isinstance(select, int) else list(select))
            kept = [position - start for position in positions if start <= position < stop]
            if not kept:
                return None
            local = torch.tensor(kept, device=value.device)
        return (slice(None),) * self.dim + (local,)
