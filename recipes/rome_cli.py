"""``gradpatch rome``: edit one fact with the ROME recipe and print its effect.

::

    gradpatch rome --subject "Eiffel Tower" --prompt "The {} is located in the city of" --target-new " Rome"
    gradpatch rome ... --model path/to/gpt2-xl --node transformer.h_17.mlp.c_proj --device cuda --save edits/eiffel

Prints the target probabilities and greedy generations before and after the edit, writes the value optimisation
and the generations to a TensorBoard run under ``--logdir``, and saves the edit (safetensors + JSON) with
``--save``. Also holds the model options shared with ``gradpatch eval-rome``.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from .cli import register_subcommand

__all__ = ["add_model_arguments", "build_editable_graph", "default_device", "register", "resolve_edit_node"]


def default_device() -> str:
    """``"cuda"`` when a GPU is visible, else ``"cpu"``."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """Add ``--model``, ``--node``, ``--device``, ``--corpus``, ``--n-samples``, ``--steps`` and ``--cache-dir``."""
    from editors.rome import DEFAULT_SMOLLM2_NODE
    from editors.stats import DEFAULT_N_SAMPLES

    p.add_argument("--model", default=None, metavar="PATH",
                   help="save_pretrained directory or .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--node", default=None, metavar="NODEPATH",
                   help=f"linear layer to edit (default for the embedded model: {DEFAULT_SMOLLM2_NODE}; "
                        "needed with --model, e.g. transformer.h_17.mlp.c_proj for GPT-2 XL)")
    p.add_argument("--device", default=None, help="torch device (default: cuda when available, else cpu)")
    p.add_argument("--corpus", default=None, metavar="FILE",
                   help="text corpus for the second moment (default: the offline English Wikipedia summaries)")
    p.add_argument("--n-samples", type=int, default=DEFAULT_N_SAMPLES, help="corpus documents (default %(default)s)")
    p.add_argument("--steps", type=int, default=25, help="maximum value-optimisation steps (default %(default)s)")
    p.add_argument("--cache-dir", default=None, help="statistics cache (default ~/.cache/gradpatch/stats)")


def resolve_edit_node(model: str | None, node: str | None, command: str) -> str | None:
    """The NodePath to edit: ``node``, or the embedded model's default; ``None`` (with the fix printed to stderr)
    when ``--model`` is given without ``--node``."""
    from editors.rome import DEFAULT_SMOLLM2_NODE

    if node is not None:
        return node
    if model is not None:
        print(f"gradpatch {command}: --model needs --node, the NodePath of the linear layer to edit, e.g. "
              "model.layers_4.mlp.down_proj (Llama) or transformer.h_17.mlp.c_proj (GPT-2 XL); "
              "`gradpatch graph --model PATH` prints the node tree", file=sys.stderr)
        return None
    return DEFAULT_SMOLLM2_NODE


def build_editable_graph(model: Any, tokenizer: Any) -> Any:
    """A :class:`gradpatch.PatchableGraph` of a causal LM for editing: built on a right-padded batch of two prompts
    with ``use_cache=False`` (so any batch size and length runs), in ``eval()``."""
    import torch

    from editors.layers import model_device
    from editors.tokens import pad_token_id, right_pad
    from gradpatch import PatchableGraph

    texts = ["The capital of France is", "The Eiffel Tower is located in the city of"]
    ids, _ = right_pad([list(tokenizer(t)["input_ids"]) for t in texts], pad_token_id(tokenizer))
    device = model_device(model)
    with torch.no_grad():
        pg = PatchableGraph(model, ids.to(device), use_cache=False)
    return pg.eval()


def _run_rome(args: argparse.Namespace) -> int:
    """Run ``gradpatch rome`` (see the module docstring); returns the exit status."""
    from editors import ROME, EditRequest, ROMEConfig
    from editors.errors import EditNotConvergedError, SubjectNotFoundError
    from gradpatch.errors import NonFiniteError
    from gradpatch.models import load_model

    from .rome_recipe import run_rome
    from .rome_value import LightningValueRunner

    node = resolve_edit_node(args.model, args.node, "rome")
    if node is None:
        return 2
    try:
        request = EditRequest(prompt=args.prompt, subject=args.subject, target_new=args.target_new.strip(),
                              target_true=(args.target_true or "").strip())
    except (ValueError, SubjectNotFoundError) as error:
        print(f"gradpatch rome: {error}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    model, tokenizer = load_model(args.model, device=args.device or default_device())
    pg = build_editable_graph(model, tokenizer)
    t1 = time.perf_counter()
    runner = LightningValueRunner(logdir=args.logdir, name="rome", progress=not args.quiet)
    config = ROMEConfig(n_samples=args.n_samples, steps=args.steps, cache_dir=args.cache_dir, progress=not args.quiet,
                        allow_unconverged=args.allow_unconverged)
    rome = ROME(pg, tokenizer, node, config=config, corpus=args.corpus, value_runner=runner)
    try:
        result = run_rome(rome, request, prompts=args.generate, max_new_tokens=args.max_new_tokens)
    except SubjectNotFoundError as error:
        print(f"gradpatch rome: {error}", file=sys.stderr)
        return 2
    except (EditNotConvergedError, NonFiniteError) as error:
        print(f"gradpatch rome: {error}", file=sys.stderr)
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
        "rome",
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
    add_model_arguments(p)
    p.add_argument("--logdir", default="runs", help="TensorBoard folder (default: %(default)s)")
    p.add_argument("--save", default=None, metavar="EDIT", help="save the edit here (edit.safetensors + edit.json)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=_run_rome)


register_subcommand("rome", register)
