"""``gradpatch trace``: causal tracing of one fact (Meng et al. 2022, section 2.1).

::

    gradpatch trace --subject "The Eiffel Tower" --prompt "{} is located in the city of" --out runs/trace
    # writes runs/trace/trace.json and runs/trace/trace_{hidden,mlp,attn}.png; --logdir adds TensorBoard images

The defaults (samples, noise level, seed, windows, batch size) are :class:`editors.causal_trace.TraceConfig`'s.
``trace.json`` carries a ``provenance`` record and ``OUT/provenance.json`` lists the files (:mod:`recipes.cli.outputs`);
an ``--out`` that holds an earlier run is refused unless ``--overwrite`` is given, and then replaced whole.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from editors.causal_trace import DEFAULT_WINDOWS, KINDS, TraceConfig

from .options import add_device_option, add_model_option, usage_error
from .outputs import PROVENANCE_NAME, add_output_options, earlier_run, staged_folder

__all__ = ["NAME", "register"]

NAME = "trace"

DEFAULT_SUBJECT = "The Eiffel Tower"
DEFAULT_TEMPLATE = "{} is located in the city of"


def _config(args: argparse.Namespace) -> TraceConfig:
    """The :class:`TraceConfig` the options ask for (``--window`` sets the MLP and attention windows)."""
    return TraceConfig(
        kinds=tuple(k.strip() for k in args.kinds.split(",") if k.strip()), samples=args.samples,
        noise_level=args.noise_level, noise_std=args.noise_std, seed=args.seed, batch_size=args.batch_size,
        windows={"mlp": args.window, "attn": args.window} if args.window is not None else {},
    )


def _run(args: argparse.Namespace) -> int:
    """Run ``gradpatch trace``; returns the exit status (2 for a usage error, with the fix on stderr)."""
    import torch

    from editors import SubjectNotFoundError, TokenizationError, TraceError
    from editors.causal_trace import causal_trace, save_trace
    from editors.passes import prompt_and_span
    from gradpatch import PatchableGraph
    from gradpatch.model_io import model_device
    from gradpatch.files.loaders import EMBEDDED_MODEL_NAME, default_device, load_model
    from gradpatch.progress import ProgressBar

    from ..reports import log_trace_to_tensorboard

    problem = earlier_run(args)
    if problem:
        return usage_error(NAME, problem)
    config = _config(args)
    unknown = [k for k in config.kinds if k not in KINDS]
    if unknown or not config.kinds:
        return usage_error(NAME, f"unknown kinds {unknown or args.kinds!r}; give a comma-separated subset of "
                                 f"{','.join(KINDS)}")
    try:
        text, _ = prompt_and_span(args.prompt, args.subject)
    except SubjectNotFoundError as error:
        return usage_error(NAME, error)

    t0 = time.perf_counter()
    model, tokenizer = load_model(args.model, device=args.device or default_device())
    t1 = time.perf_counter()
    ids = tokenizer(text, return_tensors="pt").input_ids.to(model_device(model))
    with torch.no_grad():
        pg = PatchableGraph(model, ids.expand(2, -1), use_cache=False)  # batch-2 example: every batch size fits
    t2 = time.perf_counter()

    try:
        with ProgressBar("trace", unit="row", enabled=not args.quiet) as bar:
            result = causal_trace(pg, tokenizer, args.prompt, args.subject, answer=args.answer, config=config,
                                  progress=bar)
    except (SubjectNotFoundError, TokenizationError, TraceError) as error:
        return usage_error(NAME, error)

    model_name = Path(args.model).name if args.model else EMBEDDED_MODEL_NAME
    with staged_folder(args) as folder:
        kinds = {kind: path.name for kind, path in save_trace(result, folder, model_name=model_name).items()}
    written = {kind: Path(args.out) / name for kind, name in kinds.items()}
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
    print(f"wrote {Path(args.out) / PROVENANCE_NAME}")
    if args.logdir:
        print(f"wrote TensorBoard images to {args.logdir}")
    print(f"# model loaded in {t1 - t0:.1f} s, graph built in {t2 - t1:.1f} s, trace took {result.seconds:.1f} s",
          file=sys.stderr)
    return 0


def register(subparsers: Any) -> None:
    """Add the ``trace`` parser (causal tracing) to the ``gradpatch`` sub-parsers."""
    defaults = TraceConfig()
    p = subparsers.add_parser(
        NAME,
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
    add_model_option(p)
    add_output_options(p, "output folder", default="runs/trace")
    p.add_argument("--samples", type=int, default=defaults.samples, metavar="N",
                   help="noise samples (default: %(default)s)")
    p.add_argument("--kinds", default=",".join(defaults.kinds), help="states to restore (default: %(default)s)")
    p.add_argument("--window", type=int, default=None, metavar="N",
                   help=f"layers restored at once for mlp and attn (default: {DEFAULT_WINDOWS['mlp']}; hidden: 1)")
    p.add_argument("--noise-level", type=float, default=defaults.noise_level,
                   help="noise std in units of the embeddings' std (default: %(default)s)")
    p.add_argument("--noise-std", type=float, default=defaults.noise_std,
                   help="the embeddings' std (default: measured over the embedding matrix)")
    p.add_argument("--seed", type=int, default=defaults.seed, help="noise seed (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=defaults.batch_size, metavar="ROWS",
                   help="restorations per forward pass (default: %(default)s)")
    add_device_option(p)
    p.add_argument("--logdir", metavar="DIR", default=None, help="also add the heatmaps to a TensorBoard run here")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_run)
