"""The ``gradpatch`` command line.

Subcommands are registered in :data:`SUBCOMMANDS` as ``(name, register_fn)`` pairs. ``register_fn`` receives the
argparse sub-parsers object, adds its parser and sets ``func`` (a callable ``args -> int | None``) as a default::

    from recipes.cli import register_subcommand

    def _register_eval_rome(subparsers):
        p = subparsers.add_parser("eval-rome", help="evaluate a saved ROME edit")
        p.add_argument("edit")
        p.set_defaults(func=_run_eval_rome)

    register_subcommand("eval-rome", _register_eval_rome)

Modules named in :data:`SUBCOMMAND_MODULES` are imported (when installed) before the parser is built, so a module
that registers its subcommands at import time only needs its name added there.

Implemented here: ``gradpatch graph`` (print a model's patchable graph). The others: ``gradpatch rome``
(:mod:`recipes.rome_cli`), ``gradpatch eval-rome`` (:mod:`recipes.eval_rome_cli`), ``gradpatch trace``
(:mod:`recipes.trace_cli`) and ``gradpatch fit`` (:mod:`recipes.fit_cli`).
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import re
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

RegisterFn = Callable[["argparse._SubParsersAction[argparse.ArgumentParser]"], None]

#: ``(name, register_fn)`` for every subcommand, in the order shown by ``--help``.
SUBCOMMANDS: list[tuple[str, RegisterFn]] = []

#: Modules imported before the parser is built; each may call :func:`register_subcommand` at import time.
SUBCOMMAND_MODULES: list[str] = ["recipes.rome_cli", "recipes.eval_rome_cli", "recipes.eval_edit_cli", "recipes.trace_cli",
                                 "recipes.fit_cli"]

DEFAULT_PROMPT = "The Eiffel Tower is located in the city of"


def register_subcommand(name: str, register_fn: RegisterFn) -> None:
    """Add (or replace) a subcommand of the ``gradpatch`` command.

    Args:
        name: the subcommand name, e.g. ``"eval-rome"``.
        register_fn: called with the argparse sub-parsers object; adds its parser and sets ``func``.
    """
    for i, (existing, _) in enumerate(SUBCOMMANDS):
        if existing == name:
            SUBCOMMANDS[i] = (name, register_fn)
            return
    SUBCOMMANDS.append((name, register_fn))


def _import_subcommand_modules() -> None:
    """Import the optional modules of :data:`SUBCOMMAND_MODULES` that exist (a missing one is skipped)."""
    for module_name in SUBCOMMAND_MODULES:
        try:
            importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name is not None and module_name.startswith(exc.name):
                continue  # the module (or its package) is not there: nothing to register
            # An optional dependency of that module is missing: its subcommands are unavailable,
            # the others still work.
            print(f"gradpatch: subcommands of {module_name} unavailable ({exc})", file=sys.stderr)


# --------------------------------------------------------------------------------------------- graph


def tree_depth_filter(text: str, depth: int | None) -> str:
    """Keep the lines of a drawn tree whose nesting depth is at most ``depth``.

    The depth of a line is its indentation (tree glyphs and spaces) divided by the smallest non-zero
    indentation in the drawing; the root line has depth 0.

    Args:
        text: a tree as drawn by ``repr(pg.graph)`` or ``repr(node)``.
        depth: the deepest level to keep; ``None`` keeps everything.

    Returns:
        The filtered drawing, with a final line counting the hidden lines when some were dropped.
    """
    lines = text.splitlines()
    if depth is None or not lines:
        return text
    prefix = re.compile(r"^[\s│├└─┬┼┤┐┘┌|`+\-]*")
    indents = [len(prefix.match(line).group(0)) for line in lines]  # type: ignore[union-attr]
    unit = min((i for i in indents if i > 0), default=1)
    kept = [line for line, ind in zip(lines, indents) if ind // unit <= depth]
    hidden = len(lines) - len(kept)
    if hidden:
        kept.append(f"... ({hidden} deeper lines hidden; raise --depth or pick a subtree with --node)")
    return "\n".join(kept)


def draw_tree(node: Any, depth: int | None = None) -> str:
    """Draw a ``pg.graph`` node's subtree down to ``depth`` levels.

    Args:
        node: ``pg.graph`` or any node below it.
        depth: levels below ``node`` to draw; ``None`` draws everything.

    Returns:
        The drawing (``repr(node)`` when ``depth`` is ``None``).
    """
    if depth is None:
        return repr(node)
    tree = getattr(node, "_tree", None)
    if callable(tree):
        try:
            return tree(depth)
        except TypeError:
            pass
    return tree_depth_filter(repr(node), depth)


def resolve_node(graph: Any, node_path: str) -> Any:
    """Walk ``pg.graph`` along a dot-joined NodePath (``|`` digs are walked like dots).

    Args:
        graph: ``pg.graph``.
        node_path: e.g. ``"model.layers_0.mlp"``.

    Returns:
        The node at that path.

    Raises:
        KeyError: a component does not exist; the message lists the children that do.
    """
    node = graph
    walked: list[str] = []
    for part in re.split(r"[.|]", node_path):
        if not part:
            continue
        try:
            node = getattr(node, part)
        except AttributeError:
            children = [c for c in dir(node) if not c.startswith("_")]
            close = difflib.get_close_matches(part, children, n=3)
            where = ".".join(walked) or "<root>"
            hint = f"did you mean {', '.join(close)}?" if close else f"children: {', '.join(children[:30]) or '(none)'}"
            raise KeyError(f"NodePath {node_path!r}: no node {part!r} under {where}; {hint}") from None
        walked.append(part)
    return node


def _run_graph(args: argparse.Namespace) -> int:
    """Print the patchable graph of a model (``gradpatch graph``)."""
    import torch

    from gradpatch import PatchableGraph
    from gradpatch.models import load_model

    t0 = time.perf_counter()
    model, tokenizer = load_model(args.model)
    t1 = time.perf_counter()
    input_ids = tokenizer(args.prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        pg = PatchableGraph(model, input_ids, use_cache=False)
    t2 = time.perf_counter()
    try:
        node = resolve_node(pg.graph, args.node) if args.node else pg.graph
    except KeyError as exc:
        print(f"gradpatch graph: {exc.args[0]}", file=sys.stderr)
        return 2
    print(draw_tree(node, args.depth))
    print(
        f"# model loaded in {t1 - t0:.1f} s, graph built in {t2 - t1:.1f} s "
        f"(example: {tuple(input_ids.shape)} token ids)",
        file=sys.stderr,
    )
    return 0


def _register_graph(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "graph",
        help="print a model's patchable graph (node paths and shapes)",
        description="Build a PatchableGraph of a model on a short example prompt and print its node tree.",
    )
    p.add_argument(
        "--model",
        metavar="PATH",
        default=None,
        help="save_pretrained directory or .gguf file (default: the embedded SmolLM2-135M-Instruct)",
    )
    p.add_argument("--depth", type=int, default=None, metavar="N", help="only print N levels below the shown node")
    p.add_argument("--node", default=None, metavar="PATH", help="print the subtree at this NodePath, e.g. model.layers_0.mlp")
    p.add_argument("--prompt", default=DEFAULT_PROMPT, help="example text the graph is built on (default: %(default)r)")
    p.set_defaults(func=_run_graph)


register_subcommand("graph", _register_graph)


# ---------------------------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    """Build the ``gradpatch`` argument parser from :data:`SUBCOMMANDS`.

    Returns:
        The parser; each subcommand sets ``args.func``.
    """
    _import_subcommand_modules()
    parser = argparse.ArgumentParser(
        prog="gradpatch", description="Gradient-based interventions on PyTorch models."
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for _, register_fn in SUBCOMMANDS:
        register_fn(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``gradpatch`` command.

    Args:
        argv: arguments without the program name (default: ``sys.argv[1:]``).

    Returns:
        The process exit status.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    status = args.func(args)
    return 0 if status is None else int(status)


if __name__ == "__main__":  # pragma: no cover
    # ``python -m recipes.cli``: the subcommand modules register into ``recipes.cli``, not into ``__main__``.
    from recipes.cli import main as _main

    sys.exit(_main())
