"""The lifetime of the ``torch.distributed`` process group that one of our distributed jobs starts.

Lightning's launchers start the process group (gloo on CPUs, NCCL on GPUs) but, for gloo, never destroy it (Lightning
registers an exit handler for NCCL only). A gloo group still alive when the interpreter shuts down can abort the
process (``terminate called without an active exception``, SIGABRT) although the job itself succeeded or failed
cleanly. A job that started the group therefore destroys it before it returns or raises, at a point where every
rank has finished its collectives.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["owned_process_group"]


def _initialized() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


@contextmanager
def owned_process_group() -> Iterator[None]:
    """Destroy, on leaving (normally or by an exception), the default process group started inside the block.

    A group that was already initialised on entry belongs to the caller (torchrun, the user's own script) and is left
    alone. Use it around work whose collectives all complete on every rank before the block ends (a barrier, or a
    blocking gather every rank returns or raises from): destroying a gloo group while a peer still waits on it can
    hang that peer.
    """
    started_here = not _initialized()
    try:
        yield
    finally:
        if started_here and _initialized():
            torch.distributed.destroy_process_group()
