"""A MEMIT or AlphaEdit batch edit with its facts split across processes started by Lightning (Fabric's launchers:
``ddp`` on CPUs with gloo or on GPUs with NCCL, ``num_nodes`` for several machines under torchrun or SLURM).

Each process builds the editor on its own device, runs the key passes and the value search of its share of the facts
(:class:`editors.distributed.TorchDistributedShards`), and receives every other share, so every process ends with
the same :class:`editors.BatchEdit` as one process would compute. Rank 0 alone writes it (atomic files).

The process group the launcher starts is destroyed before the function returns or raises (a gloo group left alive
can abort the process at exit).

Statistics: every process reads the second-moment cache the editor names; compute it first (``gradpatch stats``,
spread over the same processes) so that the processes do not each compute it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from lightning.fabric import Fabric

from editors import MEMIT, BatchEdit, EditRequest
from editors.distributed import FactShards, TorchDistributedShards

from .process_group import owned_process_group

#: ``build(device, shards)``: the editor on ``device`` (the model moved there), constructed with ``shards=shards``.
EditorBuilder = Callable[[torch.device, FactShards], MEMIT]


def run_distributed_edit(build: EditorBuilder, requests: Sequence[EditRequest], *, accelerator: str = "cpu",
                         devices: int = 1, num_nodes: int = 1, strategy: str = "ddp",
                         out: str | os.PathLike[str] | None = None) -> BatchEdit:
    """Compute one batch edit of ``requests`` on ``devices × num_nodes`` processes (facts split by rank).

    Call it from a script: with ``devices > 1`` Lightning's launcher starts the script again for the other local ranks
    (as for ``Trainer``), each of which calls this function with the same arguments.

    Args:
        build: makes the editor on a process's device with the given shards (``MEMIT(..., shards=shards)`` or
            AlphaEdit); every process must build the same model and configuration.
        requests: the facts (the same list on every process; at least one per process).
        accelerator, devices, num_nodes, strategy: as Lightning's ``Fabric`` (one process: ``strategy`` is ignored).
        out: folder to save the edit to (``edit.safetensors`` + ``edit.json``), written by rank 0 only.

    Returns:
        The :class:`editors.BatchEdit` (not applied), equal on every process.

    Raises:
        editors.EditError: fewer facts than processes, processes holding another model or other requests, or a
            failure on another process (every process stops; none is left waiting).
    """
    processes = devices * num_nodes
    fabric = Fabric(accelerator=accelerator, devices=devices, num_nodes=num_nodes,
                    strategy=strategy if processes > 1 else "auto")
    with owned_process_group():  # every rank leaves after the same barrier or the same failed gather
        fabric.launch()
        shards = TorchDistributedShards() if fabric.world_size > 1 else FactShards()
        editor = build(fabric.device, shards)
        batch = editor.compute(requests)
        if out is not None and fabric.global_rank == 0:
            batch.save(Path(out))
        fabric.barrier()
    return batch
