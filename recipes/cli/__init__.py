"""The ``gradpatch`` command line: one module per command, all listed in :data:`COMMANDS`.

==============  ==============================  =============================================================
command         module                          does
==============  ==============================  =============================================================
``graph``       :mod:`recipes.cli.graph`        print a model's patchable graph (NodePaths and shapes)
``rome``        :mod:`recipes.cli.rome`         edit one fact with ROME, generations before and after
``eval-rome``   :mod:`recipes.cli.eval_rome`    ROME on every case of a CounterFact file, scores to JSON
``eval-edit``   :mod:`recipes.cli.eval_edit`    ROME, MEMIT or AlphaEdit on CounterFact cases in (sequential) batches
``trace``       :mod:`recipes.cli.trace`        causal tracing of one fact, heatmaps and JSON
``attribute``   :mod:`recipes.cli.attribute`    activation patching, AtP, AtP*, EAP, EAP-IG: scores.json, heatmaps
``fit``         :mod:`recipes.cli.fit`          train an intervention from a YAML config (LightningCLI)
``stats``       :mod:`recipes.cli.stats`        second-moment statistics over GPUs/nodes, resumable (Lightning job)
``dictionary``  :mod:`recipes.cli.dictionary`   ``dictionary eval``: a saved SAE or transcoder's metrics.json
``circuit``     :mod:`recipes.cli.circuit`      attribution graph of a prompt: graph.json, graph.html, interventions
``generate``    :mod:`recipes.cli.generate`     greedy KV-cache continuations with a saved intervention
==============  ==============================  =============================================================

Options shared by several commands (``--model``, ``--node``, ``--device``, ...) are in :mod:`recipes.cli.options`.
Building the parser imports no torch (each command imports the library when it runs), so ``gradpatch --help`` and
``gradpatch COMMAND --help`` answer at once. The library never imports this package.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from . import attribute, circuit, dictionary, eval_edit, eval_rome, fit, generate, graph, rome, stats, trace

__all__ = ["COMMANDS", "build_parser", "main"]

#: The commands in the order ``--help`` lists them; each module has ``NAME`` and ``register(subparsers)``.
COMMANDS = (graph, rome, eval_rome, eval_edit, trace, attribute, fit, stats, dictionary, circuit, generate)


def build_parser() -> argparse.ArgumentParser:
    """The ``gradpatch`` argument parser with every command of :data:`COMMANDS`; each sets ``args.func``."""
    parser = argparse.ArgumentParser(prog="gradpatch", description="Gradient-based interventions on PyTorch models.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for command in COMMANDS:
        command.register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``gradpatch`` command.

    Args:
        argv: arguments without the program name (default: ``sys.argv[1:]``).

    Returns:
        The process exit status (2 for a usage error, with the fix on stderr).
    """
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    args.command_line = argv  # recorded in the provenance of what the command writes (recipes.cli.outputs)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    status = args.func(args)
    return 0 if status is None else int(status)
