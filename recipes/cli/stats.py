"""``gradpatch stats``: second-moment statistics of several layers as a distributed, resumable Lightning job.

::

    gradpatch stats --nodes model.layers_2.mlp.down_proj model.layers_3.mlp.down_proj --docs 1000
    gradpatch stats --model path/to/llama-7b --dtype bfloat16 --nodes ... --docs 100000 \\
        --accelerator gpu --devices 8 --strategy ddp [--num-nodes 2] --out /shared/stats

Writes one cache file per node where the editors look for it (``--out``, default ``~/.cache/gradpatch/stats``;
same key and format as :func:`editors.layer_second_moments`), so a later ROME/MEMIT/AlphaEdit edit with the same
model, corpus, ``--docs`` (``n_samples``), ``--max-length`` and start token (``--start-token auto`` for ROME's and
MEMIT's default) reads it instead of computing it. Each rank checkpoints
its partial sums every ``--checkpoint-every`` documents; the same command started again after a kill resumes.
Lightning starts the other ranks (or torchrun / SLURM does: run the same command on every node). See docs/scale.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

from editors import DEFAULT_MAX_LENGTH, DEFAULT_N_SAMPLES, DEFAULT_SMOLLM2_NODES

from .options import add_model_option, start_token_value, usage_error

__all__ = ["NAME", "register"]

NAME = "stats"


def _local_device(accelerator: str) -> str:
    """Where this process loads the model: its own GPU (``LOCAL_RANK`` / ``SLURM_LOCALID``; 0 for Lightning's rank 0
    before it starts the others) with ``--accelerator gpu``, else the CPU (Lightning moves it afterwards)."""
    if accelerator != "gpu":
        return "cpu"
    return f"cuda:{int(os.environ.get('LOCAL_RANK', os.environ.get('SLURM_LOCALID', '0')))}"


def _run(args: argparse.Namespace) -> int:
    """Run ``gradpatch stats`` (see the module docstring); returns the exit status."""
    import torch

    from editors import LayerKindError, editable_graph
    from editors.passes import with_start_token
    from gradpatch.errors import NonFiniteError
    from gradpatch.files.loaders import load_model

    from ..errors import StatisticsJobError
    from ..editing import SecondMomentJob, run_statistics_job

    if args.model is not None and not args.nodes:
        return usage_error(NAME, "--nodes is needed with --model, e.g. --nodes model.layers_4.mlp.down_proj")
    nodes = args.nodes or list(DEFAULT_SMOLLM2_NODES)
    t0 = time.perf_counter()
    try:
        model, tokenizer = load_model(args.model, dtype=getattr(torch, args.dtype),
                                      device=_local_device(args.accelerator))
        pg = editable_graph(model, tokenizer)
        tokenizer = with_start_token(tokenizer, start_token_value(args.start_token))
        job = SecondMomentJob(pg, tokenizer, nodes, corpus=args.corpus,
                              n_samples=args.docs, max_length=args.max_length, batch_size=args.batch_size,
                              cache_dir=args.out, partial_dir=args.partial_dir,
                              checkpoint_every=args.checkpoint_every, restart=args.restart)
    except (StatisticsJobError, FileNotFoundError, KeyError, LayerKindError, ValueError) as error:
        return usage_error(NAME, error)
    try:
        moments = run_statistics_job(job, accelerator=args.accelerator,
                                     devices=int(args.devices) if args.devices.isdigit() else args.devices,
                                     strategy=args.strategy, num_nodes=args.num_nodes,
                                     enable_progress_bar=not args.quiet)
    except (StatisticsJobError, NonFiniteError) as error:
        print(f"gradpatch {NAME}: {error}", file=sys.stderr)
        return 1
    seconds = time.perf_counter() - t0
    if job.trainer.global_rank == 0:
        for moment, path in zip(moments, job.cache_files):
            print(f"{moment.input_node}: {moment.n_samples} documents, {moment.n_tokens} tokens -> {path}")
        print(f"# {seconds:.1f} s on {job.trainer.world_size} rank(s)", file=sys.stderr)
    return 0


def register(subparsers: Any) -> None:
    """Add the ``stats`` parser to the ``gradpatch`` sub-parsers."""
    p = subparsers.add_parser(
        NAME,
        help="second-moment statistics of layers, over GPUs/nodes, resumable; writes the editors' cache files",
        description="C = E[k kᵀ] at each layer input over a corpus, split over the ranks of a Lightning strategy; "
                    "float64 sums per rank, one all-reduce per layer at the end, checkpoints for resuming.",
    )
    add_model_option(p)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                   help="model weights dtype (part of the model fingerprint; default %(default)s)")
    p.add_argument("--nodes", nargs="+", default=None, metavar="NODEPATH",
                   help="linear layers whose inputs are accumulated (default for the embedded model: "
                        f"{' '.join(DEFAULT_SMOLLM2_NODES)})")
    p.add_argument("--docs", type=int, default=DEFAULT_N_SAMPLES,
                   help="corpus documents, the editors' n_samples (default %(default)s)")
    p.add_argument("--max-length", type=int, default=DEFAULT_MAX_LENGTH,
                   help="token truncation of documents (default %(default)s)")
    p.add_argument("--corpus", default=None, metavar="FILE",
                   help="text corpus (.txt, .json, .jsonl; default: the offline English Wikipedia summaries)")
    p.add_argument("--start-token", default="none", metavar="TOKEN",
                   help="token put before every document, as the editor that reads the files does: 'none' (default: "
                        "AlphaEdit's), 'auto' (ROME's and MEMIT's default: <|endoftext|> if the vocabulary has it, "
                        "else the BOS token) or a token; part of the cache key")
    p.add_argument("--batch-size", type=int, default=16, help="documents per forward pass per rank (default 16)")
    p.add_argument("--accelerator", default="cpu", choices=("cpu", "gpu", "auto"), help="(default %(default)s)")
    p.add_argument("--devices", default="1", help="devices per node: a number, or 'auto' (default %(default)s)")
    p.add_argument("--strategy", default="auto", help="Lightning strategy, e.g. ddp (default %(default)s)")
    p.add_argument("--num-nodes", type=int, default=1, help="machines (torchrun/SLURM; default %(default)s)")
    p.add_argument("--out", default=None, metavar="DIR", help="statistics cache (default ~/.cache/gradpatch/stats)")
    p.add_argument("--partial-dir", default=None, metavar="DIR",
                   help="per-rank checkpoints of the partial sums (default OUT/partial)")
    p.add_argument("--checkpoint-every", type=int, default=1000, metavar="N",
                   help="documents per rank between checkpoints (default %(default)s)")
    p.add_argument("--restart", action="store_true", help="discard existing checkpoints instead of resuming")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_run)
