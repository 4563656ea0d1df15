"""Facts split across processes: MEMIT's and AlphaEdit's key passes and batched value search run on each rank's share
of the facts (:class:`.shards.FactShards`), and the results are gathered on every rank, so every rank computes the
same update as one process would. The processes themselves are started by Lightning (``recipes.run_distributed_edit``)
or torchrun; this package only splits and gathers.

Names are imported on first use (:func:`editors.lazy.lazy_exports`).
"""

from __future__ import annotations

from ..lazy import lazy_exports

#: Public name -> submodule that defines it.
_EXPORTS: dict[str, str] = {
    "FactShards": "shards",
    "TorchDistributedShards": "shards",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
