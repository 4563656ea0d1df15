"""The value search on a copy of the model in a lower precision (bfloat16), kept equal to the model's weights.

MEMIT's batched value search (:mod:`editors.value.batch_objective`) is most of an edit's time on a CPU: ~20 forward and backward
passes over every fact's prompts. On CPUs with AMX a bfloat16 matrix product is several times faster than a float32
one, but ``torch.autocast`` gains little there: it casts every frozen weight again at every call (autocast caches
only the casts of weights that require gradients) and its scaled-dot-product attention runs a bfloat16 backward that
is slower on CPU than the whole float32 step's attention (profiled in docs/memit.md). A copy of the model whose
weights *are* bfloat16 avoids both costs; the keys, residuals, statistics and the update stay in the model's own
dtype, so only the search's trajectory changes (its ``δ`` stays float32).

:class:`SearchCopy` holds that copy and its :class:`gradpatch.PatchableGraph`. :meth:`SearchCopy.graph` copies the
model's current weights into it first (cast), so sequential batches search on the model with the earlier batches
written. Patches active on the model's graph are not mirrored (edits written as patches rather than weights are
what quantized or offloaded models get, and those the copy refuses). Memory: the model's parameters once more, in the
copy's dtype (half of a float32 model in bfloat16).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from gradpatch.model_io import wrapped_model

from ..errors import EditError
from ..layers import editable_graph

__all__ = ["SEARCH_DTYPES", "SearchCopy", "search_dtype"]

#: dtypes the value search may run in (``MEMITConfig.value_dtype``).
SEARCH_DTYPES = ("bfloat16", "float16", "float32")


def _cpu_search_attention(model: nn.Module) -> str | None:
    """Switch a transformers model on the CPU to its eager (matrix-product) attention; return the implementation it
    now uses (``None``: not a transformers model, or not on the CPU: left as it was). A 100-fact bfloat16 step took
    4.50 s with eager attention, 5.57 s with scaled-dot-product attention's math backend (docs/memit.md)."""
    setter = getattr(model, "set_attn_implementation", None)
    if not callable(setter) or next(model.parameters()).device.type != "cpu":
        return None
    setter("eager")
    return "eager"


def search_dtype(name: str | None) -> torch.dtype | None:
    """``torch.bfloat16`` for ``"bfloat16"`` (any of :data:`SEARCH_DTYPES`); ``None`` for ``None``.

    Raises:
        ValueError: another name (the message lists the valid ones).
    """
    if name is None:
        return None
    if name not in SEARCH_DTYPES:
        raise ValueError(f"value_dtype {name!r} is not one of {', '.join(SEARCH_DTYPES)} (or None: the model's own)")
    return getattr(torch, name)


class SearchCopy:
    """A copy of ``pg``'s model in ``dtype``, with its own PatchableGraph, for the value search.

    Args:
        pg: the edited model's PatchableGraph.
        tokenizer: its tokenizer (for the copy's example inputs).
        dtype: the copy's floating-point dtype.

    Attributes:
        attention: the copy's attention implementation when the search switched it (``"eager"`` on the CPU, the
            faster there: docs/memit.md); ``None`` when left as the model's.

    Raises:
        EditError: the model's weights cannot be copied as plain tensors on one device (quantized, offloaded to the
            meta device, or spread over several devices): search in the model's own dtype (``value_dtype=None``).
    """

    def __init__(self, pg: nn.Module, tokenizer: Any, dtype: torch.dtype) -> None:
        self.model = wrapped_model(pg)
        parameters = list(self.model.parameters())
        devices = {p.device for p in parameters}
        if any(p.is_meta or not p.is_floating_point() for p in parameters) or len(devices) > 1:
            raise EditError(f"A {dtype} copy for the value search needs every weight as a plain floating-point tensor "
                            f"on one device; this model's are quantized, offloaded or spread over {len(devices)} "
                            f"devices: pass value_dtype=None to search in the model's own dtype")
        self.dtype = dtype
        self.copy = copy.deepcopy(self.model).eval()
        for parameter in self.copy.parameters():  # buffers keep their dtype (rotary frequencies stay float32)
            parameter.data = parameter.data.to(dtype)
        self.attention = _cpu_search_attention(self.copy)
        self.pg = editable_graph(self.copy, tokenizer)

    def graph(self) -> nn.Module:
        """The copy's PatchableGraph, after copying the model's current parameters and buffers into
        the copy (parameters cast to its dtype)."""
        with torch.no_grad():
            for source, target in zip(self.model.parameters(), self.copy.parameters()):
                target.copy_(source)
            for source, target in zip(self.model.buffers(), self.copy.buffers()):
                target.copy_(source)
        return self.pg
