"""``gradpatch graph``: print a model's patchable graph (NodePaths and the shapes seen on an example prompt).

::

    gradpatch graph --depth 3
    gradpatch graph --model path/to/model --node model.layers_0.mlp
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from .options import add_model_option, usage_error

__all__ = ["NAME", "register"]

NAME = "graph"

DEFAULT_PROMPT = "The Eiffel Tower is located in the city of"


def _run(args: argparse.Namespace) -> int:
    """Print the patchable graph of a model; returns the exit status (2 for an unknown ``--node``)."""
    import torch

    from gradpatch import NodePathError, PatchableGraph
    from gradpatch.files.loaders import load_model

    t0 = time.perf_counter()
    model, tokenizer = load_model(args.model)
    t1 = time.perf_counter()
    input_ids = tokenizer(args.prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        pg = PatchableGraph(model, input_ids, use_cache=False)
    t2 = time.perf_counter()
    try:
        drawing = pg.draw(args.node or "", args.depth)
    except NodePathError as error:
        return usage_error(NAME, error)
    print(drawing)
    print(f"# model loaded in {t1 - t0:.1f} s, graph built in {t2 - t1:.1f} s "
          f"(example: {tuple(input_ids.shape)} token ids)", file=sys.stderr)
    return 0


def register(subparsers: Any) -> None:
    """Add the ``graph`` parser to the ``gradpatch`` sub-parsers."""
    p = subparsers.add_parser(
        NAME,
        help="print a model's patchable graph (node paths and shapes)",
        description="Build a PatchableGraph of a model on a short example prompt and print its node tree.",
    )
    add_model_option(p)
    p.add_argument("--depth", type=int, default=None, metavar="N", help="only print N levels below the shown node")
    p.add_argument("--node", default=None, metavar="PATH",
                   help="print the subtree at this NodePath, e.g. model.layers_0.mlp")
    p.add_argument("--prompt", default=DEFAULT_PROMPT, help="example text the graph is built on (default: %(default)r)")
    p.set_defaults(func=_run)
