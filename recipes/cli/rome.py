"""``gradpatch rome``: edit one fact with the ROME recipe and print its effect.

::

    gradpatch rome --subject "Eiffel Tower" --prompt "The {} is located in the city of" --target-new " Rome"
    gradpatch rome ... --model path/to/gpt2-xl --node transformer.h_17.mlp.c_proj --device cuda --save edits/eiffel

Prints the target probabilities and greedy generations before and after the edit, writes the value optimisation
and the generations to a TensorBoard run under ``--logdir``, and saves the edit (safetensors + JSON) with
``--save``.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from .options import add_edit_options, start_token_setting, usage_error

__all__ = ["NAME", "register"]

NAME = "rome"


def _run_rome(args: argparse.Namespace) -> int:
    """Run ``gradpatch rome`` (see the module docstring); returns the exit status."""
    from editors import ROME, EditRequest, ROMEConfig, editable_graph
    from editors import EditNotConvergedError, SubjectNotFoundError
    from gradpatch.errors import NonFiniteError
    from gradpatch.files.loaders import default_device, load_model

    from ..errors import RecipeConfigError
    from ..editing import LightningValueRunner, edit_node, run_rome

    try:
        node = edit_node(args.model, args.node)
        request = EditRequest(prompt=args.prompt, subject=args.subject, target_new=args.target_new.strip(),
                              target_true=(args.target_true or "").strip())
    except (RecipeConfigError, ValueError, SubjectNotFoundError) as error:
        return usage_error(NAME, error)
    t0 = time.perf_counter()
    model, tokenizer = load_model(args.model, device=args.device or default_device())
    pg = editable_graph(model, tokenizer)
    t1 = time.perf_counter()
    runner = LightningValueRunner(logdir=args.logdir, name="rome", progress=not args.quiet)
    config = ROMEConfig(n_samples=args.n_samples, steps=args.steps, cache_dir=args.cache_dir, progress=not args.quiet,
                        allow_unconverged=args.allow_unconverged, **start_token_setting(args))
    try:
        rome = ROME(pg, tokenizer, node, config=config, corpus=args.corpus, value_runner=runner)
    except ValueError as error:  # a --start-token the tokenizer has not
        return usage_error(NAME, error)
    try:
        result = run_rome(rome, request, prompts=args.generate, max_new_tokens=args.max_new_tokens)
    except SubjectNotFoundError as error:
        return usage_error(NAME, error)
    except (EditNotConvergedError, NonFiniteError) as error:
        print(f"gradpatch {NAME}: {error}", file=sys.stderr)
        return 1
    edit = result.edit
    print(f"edited {edit.node}: {request.text!r} -> {request.target_new!r} "
          f"({edit.info['steps']} optimiser steps, loss {edit.info['loss']:.4f})")
    for name, target in (("new", request.target_new), ("true", request.target_true)):
        if name in result.probabilities["before"]:
            print(f"  P({target!r}): {result.probabilities['before'][name]:.4f} -> "
                  f"{result.probabilities['after'][name]:.4f}")
    for prompt, before, after in zip(result.prompts, result.before, result.after):
        print(f"{prompt!r}\n  before: {before!r}\n  after:  {after!r}")
    if args.save:
        print(f"saved the edit to {edit.save(args.save)}")
    if result.log_dir:
        print(f"TensorBoard run: {result.log_dir}  (open with: tensorboard --logdir {args.logdir})")
    print(f"# model and graph {t1 - t0:.1f} s, statistics {result.seconds['statistics']:.1f} s, "
          f"edit {result.seconds['edit']:.1f} s, generations {result.seconds['generate']:.1f} s", file=sys.stderr)
    return 0


def register(subparsers: Any) -> None:
    """Add the ``rome`` parser to the ``gradpatch`` sub-parsers."""
    p = subparsers.add_parser(
        NAME,
        help="edit one fact with ROME; print predictions and generations before and after",
        description="ROME recipe: key -> second-moment statistics -> value (Trainer.fit) -> rank-one update. "
                    "The value optimisation and the generations are logged to TensorBoard.",
    )
    p.add_argument("--subject", required=True, help="the subject, e.g. 'Eiffel Tower'")
    p.add_argument("--prompt", required=True, help="the prompt with '{}' for the subject, e.g. 'The {} is located in'")
    p.add_argument("--target-new", required=True, help="the new object, e.g. ' Rome' (surrounding spaces are dropped)")
    p.add_argument("--target-true", default=None, help="the current object, to print its probability too")
    p.add_argument("--generate", nargs="*", default=[], metavar="PROMPT",
                   help="more prompts to generate from before and after (paraphrases, neighbours)")
    p.add_argument("--max-new-tokens", type=int, default=8, help="tokens per greedy generation (default %(default)s)")
    p.add_argument("--allow-unconverged", action="store_true",
                   help="apply the edit even if its value search did not converge (its last loss not below its first)")
    add_edit_options(p)
    p.add_argument("--logdir", default="runs", help="TensorBoard folder (default: %(default)s)")
    p.add_argument("--save", default=None, metavar="EDIT", help="save the edit here (edit.safetensors + edit.json)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=_run_rome)
