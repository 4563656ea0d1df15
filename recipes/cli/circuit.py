"""``gradpatch circuit``: the attribution graph of one prompt over transcoder features (circuit-tracer's method), its
files, a self-contained HTML page, TensorBoard summaries, and interventions on its features.

::

    gradpatch circuit --prompt "The capital of France is" --dictionaries transcoders/ --out runs/circuit
    gradpatch circuit --prompt "..." --dictionaries ct/ --max-feature-nodes 2000 \\
        --intervene ablate:12:5:1234 --intervene steer:3:-1:42=4.0 --out runs/circuit

``--dictionaries DIR``: ``DIR/layer_<i>/`` folders written by ``save_dictionary`` (one transcoder per layer; any
subset of layers), or a circuit-tracer ``DIR/config.yaml`` whose transcoders read ``--input-node`` and write
``--output-node`` (templates with ``{layer}``; :func:`gradpatch.circuits.load_transcoders`). Writes
``OUT/adjacency.safetensors`` + ``OUT/nodes.json`` (the unpruned graph), ``OUT/graph.json`` (the pruned graph in
circuit-tracer's frontend format), ``OUT/graph.html`` (one self-contained page), ``OUT/tensorboard/`` (scores, top
nodes and edges as text, a feature-influence image) and, with ``--intervene``, ``OUT/interventions.json`` (the top
logits before and after), every JSON file with a ``provenance`` record (the command line, every option, the
versions) and ``OUT/provenance.json`` listing every file (:mod:`recipes.cli.outputs`). An ``--out`` that holds an
earlier run is refused unless ``--overwrite`` is given, and then replaced whole. Bad input exits with status 2, the fix
on stderr, and writes nothing. A progress bar on stderr (off with ``--quiet``) counts the steps. See docs/circuits.md.

Position 0, as circuit-tracer 0.5.0 does: a prompt whose first token is not a special token gets one prepended (the
tokenizer's BOS, else its pad, EOS or first special token), and position 0 has no feature nodes and its error nodes
no edges (:func:`gradpatch.circuits.attribute`'s ``zero_first_position``); positions, ``--intervene``'s included,
count the prepended token. ``--keep-first-position`` takes the prompt as tokenized and keeps position 0's nodes.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .options import add_device_option, add_model_option, other_model_error, usage_error
from .outputs import PROVENANCE_NAME, add_output_options, earlier_run, staged_folder

if TYPE_CHECKING:
    from gradpatch.circuits import FeatureEdit
    from gradpatch.progress import ProgressBar

__all__ = ["NAME", "parse_edit", "register", "with_special_first"]

NAME = "circuit"
_EDIT = re.compile(r"(ablate|scale|clamp|steer):(-?\d+):(-?\d+):(\d+)(?:=(-?[0-9.eE+-]+))?")


def parse_edit(text: str) -> Any:
    """``KIND:LAYER:POSITION:FEATURE[=VALUE]`` as a :class:`gradpatch.circuits.FeatureEdit`.

    Raises:
        ValueError: another form, a value missing for scale, clamp or steer, or given for ablate.
    """
    from gradpatch.circuits import FeatureEdit

    match = _EDIT.fullmatch(text.strip())
    if match is None:
        raise ValueError(f"--intervene {text!r}: write KIND:LAYER:POSITION:FEATURE[=VALUE], KIND one of ablate, "
                         f"scale, clamp, steer (e.g. ablate:1:5:42 or steer:0:-1:7=4.0)")
    kind, layer, position, feature, value = match.groups()
    if (value is None) != (kind == "ablate"):
        raise ValueError(f"--intervene {text!r}: {kind} takes {'no value' if kind == 'ablate' else 'a =VALUE'}")
    try:
        number = float(value) if value is not None else 0.0
    except ValueError as error:
        raise ValueError(f"--intervene {text!r}: {value!r} is not a number") from error
    return FeatureEdit(int(layer), int(position), int(feature), kind, number)


def with_special_first(ids: Any, tokenizer: Any) -> Any:
    """``ids`` ``[1, seq]`` with a special token prepended where the first is not one (circuit-tracer 0.5.0's
    ``ensure_tokenized``: the tokenizer's BOS, else pad, EOS or its first special token; none: ``ids`` as they
    are)."""
    import torch

    special = list(tokenizer.all_special_ids)
    if int(ids[0, 0]) in special:
        return ids
    candidates = [tokenizer.bos_token_id, tokenizer.pad_token_id, tokenizer.eos_token_id, *special]
    first = next((token for token in candidates if token is not None), None)
    if first is None:
        return ids
    return torch.cat([torch.full((1, 1), int(first), dtype=ids.dtype, device=ids.device), ids], 1)


def _check_numbers(args: argparse.Namespace) -> str | None:
    """The usage error of a numeric option out of range, else ``None``."""
    for name in ("batch_size", "max_n_logits", "top_k"):
        if getattr(args, name) < 1:
            return f"--{name.replace('_', '-')} {getattr(args, name)}: give at least 1"
    if args.max_feature_nodes is not None and args.max_feature_nodes < 1:
        return f"--max-feature-nodes {args.max_feature_nodes}: give at least 1 (or leave it out for every feature)"
    for name in ("node_threshold", "edge_threshold", "desired_logit_prob"):
        if not 0.0 <= getattr(args, name) <= 1.0:
            return f"--{name.replace('_', '-')} {getattr(args, name)}: give a fraction between 0 and 1"
    return None


def _run(args: argparse.Namespace) -> int:
    """Run ``gradpatch circuit`` (module docstring); returns the exit status."""
    problem = _check_numbers(args) or earlier_run(args)
    if problem:
        return usage_error(NAME, problem)
    try:
        edits = [parse_edit(text) for text in args.intervene]
    except ValueError as error:
        return usage_error(NAME, error)

    from gradpatch.files.loaders import default_device
    from gradpatch.progress import ProgressBar

    t0 = time.perf_counter()
    device = args.device or default_device()
    steps = 3 + bool(edits) + (args.max_feature_nodes is not None)  # load, [intervene], attribute, [limit], write
    with ProgressBar("circuit", unit="step", total=steps, enabled=not args.quiet) as bar:
        return _trace(args, edits, device, bar, t0)


def _trace(args: argparse.Namespace, edits: list[FeatureEdit], device: str, bar: ProgressBar, t0: float) -> int:
    """Load, attribute, intervene and write (``bar`` advanced after each step); returns the exit status."""
    import torch

    from gradpatch import PatchableGraph
    from gradpatch.circuits import (ReplacementModel, attribute, graph_influence, graph_scores, intervene,
                                    intervene_direct, limit_features, load_transcoders)
    from gradpatch.errors import FingerprintMismatchError, GradpatchError
    from gradpatch.files.loaders import EMBEDDED_MODEL_NAME, load_model

    from ..reports.circuit_report import intervention_record, save_circuit

    try:
        model, tokenizer = load_model(args.model, device=device)
        ids = tokenizer(args.prompt, return_tensors="pt").input_ids.to(device)
        if ids.shape[1] < 1:
            return usage_error(NAME, "--prompt gave no token; give some text")
        if not args.keep_first_position:
            ids = with_special_first(ids, tokenizer)
        with torch.no_grad():  # built on a short prefix: the prompt's length is checked against the context below
            pg = PatchableGraph(model, ids[:, :2], use_cache=False).eval()
        transcoders = {layer: transcoder.to(device) for layer, transcoder in load_transcoders(
            args.dictionaries, model, *_mlp_templates(args, pg)).items()}
        replacement = ReplacementModel(pg, transcoders, ids)
        bar.advance()
        if not edits:  # before the graph: two forward passes, and a bad edit is refused at once
            result = None
        elif args.direct_effects:
            result = intervene_direct(replacement, edits, top_k=args.top_k)
        else:
            result = intervene(pg, transcoders, ids, edits, freeze_attention=not args.live_attention, top_k=args.top_k)
        bar.advance(1 if edits else 0)
        graph = attribute(replacement, max_n_logits=args.max_n_logits, desired_logit_prob=args.desired_logit_prob,
                          batch_size=args.batch_size, zero_first_position=not args.keep_first_position)
        bar.advance()
        total = graph.n_features
        if args.max_feature_nodes is not None:
            graph = limit_features(graph, args.max_feature_nodes, batch_size=args.batch_size)
            bar.advance()
        decode = lambda token: tokenizer.decode([token])  # noqa: E731
        record = intervention_record(result, edits, decode) if result is not None else None
        model_name = Path(args.model).name if args.model else EMBEDDED_MODEL_NAME
        unpruned = graph_influence(graph)  # once: pruning, the scores and the report's figure start from it
        with staged_folder(args) as folder:
            names = [path.name for path in save_circuit(
                graph, folder, decode=decode, prompt=args.prompt, slug=model_name, node_threshold=args.node_threshold,
                edge_threshold=args.edge_threshold, unpruned=unpruned, intervention=record)]
        bar.advance()
    except FingerprintMismatchError:
        return usage_error(NAME, other_model_error("--dictionaries", args.dictionaries, args.model))
    except (GradpatchError, FileNotFoundError) as error:  # OutputExistsError is a GradpatchError
        return usage_error(NAME, error)
    replacement_score, completeness = graph_scores(graph, unpruned)
    print(f"{graph.n_features} of {total} active features, {graph.adjacency.shape[0]} nodes; replacement score "
          f"{replacement_score:.3f}, completeness {completeness:.3f}")
    for token, p in zip(graph.logit_tokens.tolist(), graph.logit_probabilities.tolist()):
        print(f"  logit {decode(token)!r} p={p:.3f}")
    if record is not None:
        for edit in record["edits"]:
            print(f"  {edit['kind']} layer {edit['layer']} position {edit['position']} feature {edit['feature']} "
                  f"(a={edit['activation']:.4g})")
        for side in ("top_before", "top_after"):
            print(f"  {side}: " + ", ".join(f"{t['text']!r} {t['probability']:.3f}" for t in record[side][:5]))
    for name in [*names, PROVENANCE_NAME]:
        print(f"wrote {Path(args.out) / name}")
    print(f"# {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return 0


def _mlp_templates(args: argparse.Namespace, pg: Any) -> tuple[str, str]:
    """``--input-node`` / ``--output-node``, each defaulting to the model layout's MLP input and output templates
    (:meth:`gradpatch.layouts.ModelLayout.template`; read for a circuit-tracer ``config.yaml`` only).

    Raises:
        gradpatch.errors.LayoutError: a template is missing and no known layout fits the model (give both flags).
    """
    if args.input_node and args.output_node:
        return args.input_node, args.output_node
    from gradpatch.layouts import detect_layout

    layout = detect_layout(pg)
    return args.input_node or layout.template("mlp_input"), args.output_node or layout.template("mlp")


def register(subparsers: Any) -> None:
    """Add the ``circuit`` parser to the ``gradpatch`` sub-parsers."""
    p = subparsers.add_parser(
        NAME, help="attribution graph of one prompt over transcoder features: graph.json, graph.html, interventions",
        description="Build the attribution graph of a prompt's next-token prediction (circuit-tracer's method) and "
                    "write OUT/adjacency.safetensors, OUT/nodes.json, OUT/graph.json, OUT/graph.html and "
                    "OUT/tensorboard; see docs/circuits.md.")
    p.add_argument("--prompt", required=True, metavar="TEXT", help="the prompt (tokenized as the tokenizer does)")
    p.add_argument("--dictionaries", required=True, metavar="DIR",
                   help="layer_<i>/ folders written by save_dictionary, or a circuit-tracer config.yaml")
    add_output_options(p, "output folder")
    add_model_option(p)
    add_device_option(p)
    p.add_argument("--max-feature-nodes", type=int, default=None, metavar="N",
                   help="keep at most N features, chosen as circuit-tracer does (by influence on the logits) "
                        "(default: all)")
    p.add_argument("--batch-size", type=int, default=16, metavar="N", help="targets per backward pass "
                                                                          "(default %(default)s)")
    p.add_argument("--node-threshold", type=float, default=0.8, help="fraction of influence the pruned graph's "
                                                                      "nodes keep (default %(default)s)")
    p.add_argument("--edge-threshold", type=float, default=0.98, help="fraction of edge influence kept "
                                                                       "(default %(default)s)")
    p.add_argument("--max-n-logits", type=int, default=10, help="logit nodes at most (default %(default)s)")
    p.add_argument("--desired-logit-prob", type=float, default=0.95,
                   help="logit nodes until their probability reaches this (default %(default)s)")
    p.add_argument("--keep-first-position", action="store_true",
                   help="take the prompt as tokenized and keep position 0's features and errors as nodes (default: "
                        "circuit-tracer 0.5.0's convention: a special token prepended where the prompt lacks one, "
                        "no nodes at position 0)")
    p.add_argument("--input-node", default=None, metavar="TEMPLATE",
                   help="NodePath a circuit-tracer transcoder reads, {layer} for the layer (default: the model "
                        "layout's MLP input, model.layers_{layer}.mlp.x for Llama-style models)")
    p.add_argument("--output-node", default=None, metavar="TEMPLATE",
                   help="NodePath a circuit-tracer transcoder writes (default: what the model layout's MLP adds to "
                        "the residual stream, model.layers_{layer}.mlp.output for Llama-style models)")
    p.add_argument("--intervene", action="append", default=[], metavar="KIND:LAYER:POS:FEATURE[=VALUE]",
                   help="edit a feature (ablate, scale, clamp, steer) and report the top logits before and after; "
                        "repeat for several")
    p.add_argument("--live-attention", action="store_true",
                   help="let attention patterns respond to the edits (default: frozen, circuit-tracer's default)")
    p.add_argument("--direct-effects", action="store_true",
                   help="run the edits in the frozen replacement model (attention, norms and MLP outputs frozen: "
                        "circuit-tracer's direct_effects), where a logit changes by the graph's direct edges")
    p.add_argument("--top-k", type=int, default=10, help="top logits reported per intervention "
                                                         "(default %(default)s)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_run)
