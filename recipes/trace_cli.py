"""The ``gradpatch trace`` subcommand: causal tracing of one fact (Meng et al. 2022, section 2.1).

Registered with :func:`recipes.cli.register_subcommand` when :mod:`recipes.cli` imports this module (it is listed
in ``recipes.cli.SUBCOMMAND_MODULES``)::

    gradpatch trace --subject "The Eiffel Tower" --prompt "{} is located in the city of" --out runs/trace
    # writes runs/trace/trace.json and runs/trace/trace_{hidden,mlp,attn}.png; --logdir adds TensorBoard images
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from editors.causal_trace import DEFAULT_WINDOWS, KINDS

from .cli import register_subcommand

__all__ = ["advance", "register"]

DEFAULT_SUBJECT = "The Eiffel Tower"
DEFAULT_TEMPLATE = "{} is located in the city of"


def advance(bar: Any) -> Callable[[int, int], None]:
    """A ``progress(done, total)`` callback (as :func:`editors.causal_trace.causal_trace` takes) that moves a tqdm
    ``bar``."""

    def update(done: int, total: int) -> None:
        bar.total = total
        bar.update(done - bar.n)

    return update


def _run_trace(args: argparse.Namespace) -> int:
    """Run ``gradpatch trace``; returns the exit status (2 for a usage error, with the fix on stderr)."""
    import torch
    from tqdm import tqdm

    from gradpatch import PatchableGraph
    from gradpatch.models import EMBEDDED_MODEL_NAME, load_model

    from editors.causal_trace import (
        TraceError,
        _prompt_and_span,
        causal_trace,
        log_trace_to_tensorboard,
        save_trace,
    )
    from editors.errors import SubjectNotFoundError, TokenizationError
    from editors.layers import model_device

    from .rome_cli import default_device

    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    unknown = [k for k in kinds if k not in KINDS]
    if unknown or not kinds:
        print(f"gradpatch trace: unknown kinds {unknown or args.kinds!r}; give a comma-separated subset of "
              f"{','.join(KINDS)}", file=sys.stderr)
        return 2
    try:
        text, _ = _prompt_and_span(args.prompt, args.subject)
    except SubjectNotFoundError as error:
        print(f"gradpatch trace: {error}", file=sys.stderr)
        return 2

    t0 = time.perf_counter()
    model, tokenizer = load_model(args.model, device=args.device or default_device())
    t1 = time.perf_counter()
    ids = tokenizer(text, return_tensors="pt").input_ids.to(model_device(model))
    with torch.no_grad():
        pg = PatchableGraph(model, ids.expand(2, -1), use_cache=False)  # batch-2 example: every batch size fits
    t2 = time.perf_counter()

    windows = {"mlp": args.window, "attn": args.window} if args.window is not None else None
    bar = tqdm(total=0, unit="row", desc="trace", file=sys.stderr, disable=args.quiet)

    try:
        result = causal_trace(
            pg, tokenizer, args.prompt, args.subject, answer=args.answer, kinds=kinds, samples=args.samples,
            noise_level=args.noise_level, noise_std=args.noise_std, seed=args.seed, windows=windows,
            batch_size=args.batch_size, progress=advance(bar),
        )
    except (SubjectNotFoundError, TokenizationError, TraceError) as error:
        bar.close()
        print(f"gradpatch trace: {error}", file=sys.stderr)
        return 2
    bar.close()

    model_name = Path(args.model).name if args.model else EMBEDDED_MODEL_NAME
    written = save_trace(result, args.out, model_name=model_name)
    if args.logdir:
        log_trace_to_tensorboard(result, args.logdir, model_name=model_name)

    s0, s1 = result.subject_range
    print(f"prompt: {result.prompt!r}  subject tokens {s0}..{s1 - 1}: {result.tokens[s0:s1]}")
    print(f"answer {result.answer!r}: clean p = {result.clean_prob:.4f}, corrupted p = {result.corrupted_prob:.4f} "
          f"(noise {result.noise_level:g} x {result.noise_std:.4g}, {result.noise_std_source}, "
          f"{result.samples} samples)")
    for kind, trace in result.kinds.items():
        layer, tok, prob = trace.peak()
        sub_layer, _, sub_prob = trace.peak(s1 - 1)
        print(f"{kind:>6}: peak p = {prob:.4f} at layer {layer}, token {tok} {result.tokens[tok]!r}; "
              f"at the last subject token: p = {sub_prob:.4f} at layer {sub_layer} (window {trace.window})")
    print(f"wrote {written['json']}")
    for kind in result.kinds:
        print(f"wrote {written[kind]}")
    if args.logdir:
        print(f"wrote TensorBoard images to {args.logdir}")
    print(f"# model loaded in {t1 - t0:.1f} s, graph built in {t2 - t1:.1f} s, trace took {result.seconds:.1f} s",
          file=sys.stderr)
    return 0


def register(subparsers: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    """Add the ``trace`` subparser (causal tracing) to the ``gradpatch`` command."""
    p = subparsers.add_parser(
        "trace",
        help="causal tracing: which layers and tokens carry a fact (ROME paper, section 2)",
        description=(
            "Corrupt the subject's token embeddings with Gaussian noise, then restore the clean hidden state, "
            "MLP output or attention output at each (layer, token) and measure the probability of the answer. "
            "Writes OUT/trace.json and OUT/trace_<kind>.png."
        ),
    )
    p.add_argument("--subject", default=DEFAULT_SUBJECT, help="the subject to corrupt (default: %(default)r)")
    p.add_argument("--prompt", default=DEFAULT_TEMPLATE,
                   help="prompt with '{}' for the subject, or a text containing it (default: %(default)r)")
    p.add_argument("--answer", default=None,
                   help="answer whose first token is scored (default: the clean greedy prediction)")
    p.add_argument("--model", metavar="PATH", default=None,
                   help="save_pretrained directory or .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--out", metavar="DIR", default="runs/trace", help="output folder (default: %(default)s)")
    p.add_argument("--samples", type=int, default=10, metavar="N", help="noise samples (default: %(default)s)")
    p.add_argument("--kinds", default=",".join(KINDS), help="states to restore (default: %(default)s)")
    p.add_argument("--window", type=int, default=None, metavar="N",
                   help=f"layers restored at once for mlp and attn (default: {DEFAULT_WINDOWS['mlp']}; hidden: 1)")
    p.add_argument("--noise-level", type=float, default=3.0,
                   help="noise std in units of the embeddings' std (default: %(default)s)")
    p.add_argument("--noise-std", type=float, default=None,
                   help="the embeddings' std (default: measured over the embedding matrix)")
    p.add_argument("--seed", type=int, default=1, help="noise seed (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=256, metavar="ROWS",
                   help="restorations per forward pass (default: %(default)s)")
    p.add_argument("--device", default=None, help="torch device (default: cuda when available, else cpu)")
    p.add_argument("--logdir", metavar="DIR", default=None, help="also add the heatmaps to a TensorBoard run here")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_run_trace)


register_subcommand("trace", register)
