"""``gradpatch attribute``: where a behaviour lives — the exact activation-patching sweep or its gradient estimates.

::

    gradpatch attribute --prompts ioi.jsonl --method atp --nodes heads --out runs/ioi
    # writes runs/ioi/scores.json, runs/ioi/heatmap_heads.png and a TensorBoard run runs/ioi/tensorboard/

FILE is JSONL, one ``{"clean", "corrupted", "answer", "foil"}`` per line, every line of one token length; the metric is
the mean logit difference (answer − foil) at the last position. ``scores.json`` carries a ``provenance`` record and
``OUT/provenance.json`` lists the files (:mod:`recipes.cli.outputs`); an ``--out`` that holds an earlier run is
refused unless ``--overwrite`` is given, and then replaced whole. See docs/attribution.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from .options import add_device_option, add_model_option, usage_error
from .outputs import PROVENANCE_NAME, add_output_options, earlier_run, staged_folder

__all__ = ["METHODS", "NAME", "register"]

NAME = "attribute"

#: The methods ``--method`` takes (node methods score units; edge methods score edges and a faithfulness curve).
METHODS = ("exact", "atp", "atp-ig", "atp-star", "eap", "eap-ig")
#: ``--nodes`` choices besides NodePaths.
NODE_KINDS = ("resid", "heads", "mlp", "queries", "keys", "all")


def _read_prompts(path: str) -> list[dict[str, Any]]:
    """The JSON objects of a JSONL file, one per non-blank line.

    Raises:
        ValueError: a line that is not a JSON object (naming the line), an empty file.
        OSError: the file cannot be read.
    """
    records = []
    for number, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path} line {number} is not JSON ({error.msg}); write one "
                             f"{{\"clean\", \"corrupted\", \"answer\", \"foil\"}} object per line") from error
        if not isinstance(record, dict):
            raise ValueError(f"{path} line {number} is not a JSON object")
        records.append(record)
    if not records:
        raise ValueError(f"{path} holds no prompts; write one {{\"clean\", \"corrupted\", \"answer\", \"foil\"}} "
                         f"object per line")
    return records


def _nodes(text: str) -> str | list[str]:
    parts = [part.strip() for part in text.split(",") if part.strip()]
    return parts[0] if len(parts) == 1 else parts


def _run(args: argparse.Namespace) -> int:
    """Run ``gradpatch attribute``; returns the exit status (2 for a usage error, with the fix on stderr)."""
    if args.batch_size < 1:
        return usage_error(NAME, f"--batch-size {args.batch_size}: give at least 1 row per forward pass")
    if args.verify is not None and (args.verify < 1 or args.method in ("exact", "eap", "eap-ig")):
        return usage_error(NAME, f"--verify {args.verify} --method {args.method}: --verify takes a count of at least 1 "
                                 f"and an estimate of node scores (atp, atp-ig, atp-star); exact scores need no "
                                 f"verification, and edge methods are checked with edge patching")
    problem = earlier_run(args)
    if problem:
        return usage_error(NAME, problem)
    try:
        records = _read_prompts(args.prompts)
    except (OSError, ValueError) as error:
        return usage_error(NAME, error)

    import torch

    from gradpatch.progress import ProgressBar
    from gradpatch import PatchableGraph
    from gradpatch.attribution import AttributionError, prompt_batch, resolve_nodes, verify_top
    from gradpatch.attribution.methods import run_method
    from gradpatch.errors import NonFiniteError
    from gradpatch.files.loaders import EMBEDDED_MODEL_NAME, default_device, load_model

    from ..reports import save_attribution

    t0 = time.perf_counter()
    model, tokenizer = load_model(args.model, device=args.device or default_device())
    try:
        batch = prompt_batch(tokenizer, records).to(next(model.parameters()).device)
    except AttributionError as error:
        return usage_error(NAME, f"{args.prompts}: {error}")
    with torch.no_grad():
        pg = PatchableGraph(model, batch.clean[:1].expand(2, -1), use_cache=False)
    t1 = time.perf_counter()
    try:
        nodes = resolve_nodes(pg, _nodes(args.nodes)) if args.method not in ("eap", "eap-ig") else []
        with ProgressBar(f"attribute {args.method}", unit="unit", enabled=not args.quiet) as bar:
            result = run_method(args.method, pg, batch, nodes, direction=args.direction, batch_size=args.batch_size,
                                steps=args.steps, grad_drop=args.grad_drop, forward_kwargs={"use_cache": False},
                                progress=bar)
        if args.verify is not None:
            with ProgressBar(f"verify the top {args.verify}", unit="unit", enabled=not args.quiet) as bar:
                result = verify_top(pg, batch, result, args.verify, batch_size=args.batch_size,
                                    forward_kwargs={"use_cache": False}, progress=bar)
    except (AttributionError, NonFiniteError) as error:
        return usage_error(NAME, error)
    model_name = Path(args.model).name if args.model else EMBEDDED_MODEL_NAME
    extra = {"model": model_name, "prompts": str(args.prompts), "n_prompts": batch.size,
             "tokens": tokenizer.convert_ids_to_tokens(batch.clean[0].tolist())}
    with staged_folder(args) as folder:
        names = [path.name for path in save_attribution(result, folder, model_name=model_name, extra=extra).values()]
    print(f"metric (mean logit difference): clean {result.metric_clean:.4f}, corrupted {result.metric_corrupted:.4f}; "
          f"{len(result.scores)} node scores, {len(result.edges)} edge scores; passes: {result.forward} forward, "
          f"{result.backward} backward, {result.seconds:.1f} s")
    for score in sorted(result.scores, key=lambda s: -abs(s.score))[:10]:
        head = "" if score.head is None else f" head {score.head}"
        measured = " (exact)" if score.exact and result.method != "exact" else ""
        print(f"  {score.score:+.4f}  {score.node} position {score.position}{head}{measured}")
    if result.faithfulness:
        print("faithfulness of the top-k edges: " + ", ".join(f"k={k}: {f:.3f}" for k, f in result.faithfulness))
    for name in [*names, PROVENANCE_NAME]:
        print(f"wrote {Path(args.out) / name}")
    print(f"# model loaded and graph built in {t1 - t0:.1f} s", file=sys.stderr)
    return 0


def register(subparsers: Any) -> None:
    """Add the ``attribute`` parser (activation patching and attribution patching) to the ``gradpatch`` sub-parsers."""
    p = subparsers.add_parser(
        NAME, help="activation patching and its gradient estimates (AtP, AtP-IG, AtP*, EAP, EAP-IG) at every node",
        description=("Score every (node, position[, head]) by the change of the mean logit difference when its "
                     "activation is patched from the corrupted run (exact), or by a gradient estimate of it. Writes "
                     "OUT/scores.json, OUT/heatmap_<kind>.png and a TensorBoard run OUT/tensorboard, all at once."))
    p.add_argument("--prompts", required=True, metavar="FILE",
                   help='JSONL, one {"clean", "corrupted", "answer", "foil"} per line, all of one token length')
    p.add_argument("--method", choices=METHODS, default="atp", help="(default: %(default)s)")
    p.add_argument("--nodes", default="all", metavar="KIND|NODEPATHS",
                   help=f"{'|'.join(NODE_KINDS)} or comma-separated kinds and NodePaths; edge methods score every "
                        f"edge instead (default: %(default)s)")
    add_output_options(p, "output folder")
    p.add_argument("--batch-size", type=int, default=32, metavar="N",
                   help="rows per forward pass of the exact sweep (default: %(default)s)")
    p.add_argument("--direction", choices=("noise", "denoise"), default="noise",
                   help="noise: corrupted values into the clean run; denoise: the reverse (default: %(default)s)")
    p.add_argument("--steps", type=int, default=5, metavar="M",
                   help="AtP-IG and EAP-IG interpolation steps (default: %(default)s)")
    p.add_argument("--grad-drop", action="store_true",
                   help="atp-star: GradDrop, one more backward pass per layer; scores become magnitudes")
    p.add_argument("--verify", type=int, default=None, metavar="K",
                   help="after an estimate (atp, atp-ig, atp-star), patch its K units of largest |score| exactly and "
                        "report their measured effects (Kramár et al. 2024's verification)")
    add_model_option(p)
    add_device_option(p)
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_run)
