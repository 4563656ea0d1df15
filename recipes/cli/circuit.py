"""``gradpatch circuit``: the attribution graph of one prompt over transcoder features (circuit-tracer's method), its
files, a self-contained HTML page, TensorBoard summaries, and interventions on its features.

::

    gradpatch circuit --prompt "The capital of France is" --dictionaries transcoders/ --out runs/circuit
    gradpatch circuit --prompt "..." --dictionaries ct/ --max-feature-nodes 2000 \\
        --intervene ablate:12:5:1234 --intervene steer:3:-1:42=4.0 --out runs/circuit

``--dictionaries DIR``: ``DIR/layer_<i>/`` folders written by ``save_dictionary`` (one transcoder per layer; any
subset of layers), ``gradpatch fit``'s output folder (its ``dictionary/<node>/`` transcoders, each placed at the layer
whose ``--output-node`` it writes), or a circuit-tracer ``DIR/config.yaml`` whose transcoders read ``--input-node``
and write ``--output-node`` (templates with ``{layer}``; :func:`gradpatch.circuits.load_transcoders`), or a
cross-layer transcoder (``save_clt``'s ``clt.json`` folder, or circuit-tracer's ``W_enc_<i>.safetensors`` files,
which read and write the same templates). Writes
``OUT/adjacency.safetensors`` + ``OUT/nodes.json`` (the unpruned graph), ``OUT/graph.json`` (the pruned graph in
circuit-tracer's frontend format), ``OUT/graph.html`` (one self-contained page), ``OUT/tensorboard/`` (scores, top
nodes and edges as text, a feature-influence image) and, with ``--intervene``, ``OUT/interventions.json`` (the top
logits before and after) and ``OUT/attribution.json`` (counts, scores, seconds and the peak memory: resident memory
on the CPU, ``torch.cuda.max_memory_allocated`` on a GPU; :mod:`recipes.cli.memory`), every JSON file with a
``provenance`` record (the command line, every option, the
versions) and ``OUT/provenance.json`` listing every file (:mod:`recipes.cli.outputs`). An ``--out`` that holds an
earlier run is refused unless ``--overwrite`` is given, and then replaced whole. With ``--head-loadings``
(:mod:`recipes.cli.circuit_qk`), the links of ``graph.json`` whose edges were split also carry their head loadings
(:func:`gradpatch.circuits.add_head_loadings`), which ``graph.html`` shows for a selected link. Bad input exits
with status 2, the fix on stderr, and writes nothing. A progress bar on stderr (off with ``--quiet``) counts the
steps. See docs/circuits.md.

Position 0, as circuit-tracer 0.5.0 does: a prompt whose first token is not a special token gets one prepended (the
tokenizer's BOS, else its pad, EOS or first special token), and position 0 has no feature nodes and its error nodes
no edges (:func:`gradpatch.circuits.attribute`'s ``zero_first_position``); positions, ``--intervene``'s included,
count the prepended token. ``--keep-first-position`` takes the prompt as tokenized and keeps position 0's nodes.

Scale: ``--max-feature-nodes N`` (default 7,500, circuit-tracer's; ``all``) computes the rows of the N features of
greatest influence only (:func:`gradpatch.circuits.attribute`), and ``--max-memory SIZE`` bounds what attribution
holds. Several prompts (``--prompt`` repeated, or ``--prompts FILE``) share one model and dictionary load and are
written to ``OUT/prompt_000/``, ``OUT/prompt_001/``, … (each folder the files above), with ``OUT/prompts.json``
listing their summaries; one ``--prompt`` writes into ``OUT`` itself.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .circuit_qk import add_qk_options, check_qk_options, write_qk_results
from .memory import PeakMemory, parse_bytes
from .options import add_device_option, add_model_option, other_model_error, usage_error
from .outputs import PROVENANCE_NAME, add_output_options, earlier_run, staged_folder

if TYPE_CHECKING:
    from gradpatch.circuits import FeatureEdit
    from gradpatch.progress import ProgressBar

__all__ = ["NAME", "parse_edit", "register"]

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


def _feature_count(text: str) -> int | None:
    """``--max-feature-nodes``: a number, or ``all`` (``None``)."""
    return None if text.strip().lower() == "all" else int(text)


def _check_numbers(args: argparse.Namespace) -> str | None:
    """The usage error of a numeric option out of range, else ``None``."""
    for name in ("batch_size", "max_n_logits", "top_k"):
        if getattr(args, name) < 1:
            return f"--{name.replace('_', '-')} {getattr(args, name)}: give at least 1"
    if args.max_feature_nodes is not None and args.max_feature_nodes < 1:
        return f"--max-feature-nodes {args.max_feature_nodes}: give at least 1 (or 'all' for every feature)"
    for name in ("node_threshold", "edge_threshold", "desired_logit_prob"):
        if not 0.0 <= getattr(args, name) <= 1.0:
            return f"--{name.replace('_', '-')} {getattr(args, name)}: give a fraction between 0 and 1"
    return None


def _read_prompts(args: argparse.Namespace) -> list[str]:
    """The prompts: every ``--prompt``, or ``--prompts FILE``'s (one per line; or JSON Lines, each an object with a
    ``"prompt"`` string; blank lines skipped).

    Raises:
        ValueError: neither or both given, a file that cannot be read, holds no prompt, or a JSON line without a
            ``"prompt"`` string (the message names the line).
    """
    if bool(args.prompt) == bool(args.prompts):
        raise ValueError("give the prompt with --prompt TEXT (repeat it for several) or --prompts FILE, one of them")
    if args.prompt:
        return list(args.prompt)
    try:
        lines = Path(args.prompts).read_text(encoding="utf-8").splitlines()
    except OSError as error:
        raise ValueError(f"--prompts {args.prompts}: {error.strerror or error}; give a text file, one prompt a "
                         f"line (or JSON Lines with a \"prompt\" key)") from error
    numbered = [(number, line) for number, line in enumerate(lines, 1) if line.strip()]
    if not numbered:
        raise ValueError(f"--prompts {args.prompts} holds no prompt; write one prompt a line")
    if not numbered[0][1].lstrip().startswith("{"):
        return [line for _, line in numbered]
    prompts = []
    for number, line in numbered:
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"--prompts {args.prompts} line {number} is not JSON ({error.msg}); write one JSON "
                             f"object a line, e.g. {{\"prompt\": \"The capital of France is\"}}") from error
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
            raise ValueError(f"--prompts {args.prompts} line {number} has no \"prompt\" string; write e.g. "
                             f"{{\"prompt\": \"The capital of France is\"}}")
        prompts.append(record["prompt"])
    return prompts


def _run(args: argparse.Namespace) -> int:
    """Run ``gradpatch circuit`` (module docstring); returns the exit status."""
    problem = _check_numbers(args) or check_qk_options(args) or earlier_run(args)
    if problem:
        return usage_error(NAME, problem)
    try:
        edits = [parse_edit(text) for text in args.intervene]
        prompts = _read_prompts(args)
        bound = None if args.max_memory is None else parse_bytes(args.max_memory)
    except ValueError as error:
        return usage_error(NAME, error)

    from gradpatch.files.loaders import default_device
    from gradpatch.progress import ProgressBar

    t0 = time.perf_counter()
    device = args.device or default_device()
    steps = 1 + len(prompts) * (2 + bool(edits))  # load, then per prompt: [intervene], attribute, write
    with ProgressBar("circuit", unit="step", total=steps, enabled=not args.quiet) as bar:
        return _trace(args, prompts, edits, bound, device, bar, t0)


def _trace(args: argparse.Namespace, prompts: list[str], edits: list[FeatureEdit], bound: int | None, device: str,
           bar: ProgressBar, t0: float) -> int:
    """Load the model and the dictionaries once, then attribute, intervene and write each prompt (``bar`` advanced
    after each step); returns the exit status."""
    import torch

    from gradpatch import PatchableGraph
    from gradpatch.circuits import load_transcoders
    from gradpatch.errors import FingerprintMismatchError, GradpatchError
    from gradpatch.files.loaders import EMBEDDED_MODEL_NAME, load_model

    try:
        model, tokenizer = load_model(args.model, device=device)
        first = _prompt_ids(args, prompts[0], tokenizer, device)
        with torch.no_grad():  # built on a short prefix: each prompt's length is checked against the context later
            pg = PatchableGraph(model, first[:, :2], use_cache=False).eval()
        loaded = load_transcoders(args.dictionaries, model, *_mlp_templates(args, pg))
        transcoders = loaded.to(device) if isinstance(loaded, torch.nn.Module) else {  # a cross-layer transcoder
            layer: transcoder.to(device) for layer, transcoder in loaded.items()}
        bar.advance()
        model_name = Path(args.model).name if args.model else EMBEDDED_MODEL_NAME
        several = len(prompts) > 1
        summaries = []
        with staged_folder(args) as folder:
            for index, prompt in enumerate(prompts):
                out = folder / f"prompt_{index:03d}" if several else folder
                slug = f"{args.slug}-{index:03d}" if several and args.slug else args.slug
                summaries.append(_one_prompt(args, pg, transcoders, tokenizer, prompt, edits, bound, device, bar,
                                             out, slug, args.scan or model_name) | (
                    {"folder": out.name, "index": index} if several else {}))
            if several:
                from gradpatch.files.atomic import atomic_write_text

                atomic_write_text(folder / "prompts.json", json.dumps(
                    {"prompts": summaries, "process_max_rss_bytes": _process_max_rss()}, indent=1))
    except FingerprintMismatchError:
        return usage_error(NAME, other_model_error("--dictionaries", args.dictionaries, args.model))
    except (GradpatchError, FileNotFoundError) as error:  # OutputExistsError is a GradpatchError
        return usage_error(NAME, error)
    for summary in summaries:
        _print_summary(args, summary, several)
    print(f"wrote {Path(args.out) / ('prompts.json' if several else PROVENANCE_NAME)}")
    if several:
        print(f"wrote {Path(args.out) / PROVENANCE_NAME}")
    print(f"# {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return 0


def _prompt_ids(args: argparse.Namespace, prompt: str, tokenizer: Any, device: str) -> Any:
    """The prompt's ids ``[1, seq]`` (a special token first unless ``--keep-first-position``).

    Raises:
        gradpatch.circuits.CircuitError: the prompt gives no token.
    """
    from gradpatch.circuits import CircuitError

    ids = tokenizer(prompt, return_tensors="pt").input_ids.to(device)
    if ids.shape[1] < 1:
        raise CircuitError(f"the prompt {prompt!r} gave no token; give some text")
    from gradpatch.circuits import with_special_first

    return ids if args.keep_first_position else with_special_first(ids, tokenizer)


def _one_prompt(args: argparse.Namespace, pg: Any, transcoders: Any, tokenizer: Any, prompt: str,
                edits: list[FeatureEdit], bound: int | None, device: str, bar: ProgressBar, out: Path,
                slug: str | None, scan: str) -> dict[str, Any]:
    """One prompt's graph, interventions and files in ``out``, its peak memory measured from before the replacement
    model is built to after the files are written; returns its summary (also written as ``out/attribution.json``)."""
    from gradpatch.circuits import (ReplacementModel, add_head_loadings, annotate_frontend, attribute, graph_influence,
                                    graph_scores, intervene, intervene_direct, live_mlp_layers, load_head_loadings)
    from gradpatch.files.atomic import atomic_write_text

    from ..reports.circuit_report import intervention_record, save_circuit

    decode = lambda token: tokenizer.decode([token])  # noqa: E731
    with PeakMemory(device) as memory:
        ids = _prompt_ids(args, prompt, tokenizer, device)
        replacement = ReplacementModel(pg, transcoders, ids)
        if not edits:  # before the graph: two forward passes, and a bad edit is refused at once
            result = None
        elif args.direct_effects:
            result = intervene_direct(replacement, edits, top_k=args.top_k)
        else:
            result = intervene(pg, transcoders, ids, edits, freeze_attention=not args.live_attention,
                               top_k=args.top_k)
        bar.advance(1 if edits else 0)
        start = time.perf_counter()
        graph = attribute(replacement, max_feature_nodes=args.max_feature_nodes, max_n_logits=args.max_n_logits,
                          desired_logit_prob=args.desired_logit_prob, batch_size=args.batch_size,
                          max_memory_bytes=bound, zero_first_position=not args.keep_first_position)
        seconds = time.perf_counter() - start
        bar.advance()
        record = intervention_record(result, edits, decode) if result is not None else None
        unpruned = graph_influence(graph)  # once: pruning, the scores and the report's figure start from it
        names = [path.name for path in write_qk_results(args, replacement, graph, out, decode)]
        loadings = load_head_loadings(out) if args.head_loadings else None  # written just now, onto graph.json's links
        annotated = partial(annotate_frontend, graph=graph, replacement=replacement, decode=decode, unpruned=unpruned)

        def annotate(frontend: dict[str, Any]) -> dict[str, Any]:
            return annotated(frontend) if loadings is None else add_head_loadings(annotated(frontend), graph, loadings)

        names += [path.name for path in save_circuit(
            graph, out, decode=decode, prompt=prompt, slug=slug, scan=scan, node_threshold=args.node_threshold,
            edge_threshold=args.edge_threshold, unpruned=unpruned, intervention=record, annotate=annotate)]
        live = live_mlp_layers(replacement)
        del replacement
        replacement_score, completeness = graph_scores(graph, unpruned)
    summary = {"prompt": prompt, "tokens": graph.n_pos, "active_features": graph.total_features,
               "features": graph.n_features, "nodes": graph.n_nodes,
               "logits": [{"token": t, "text": decode(t), "probability": p}
                          for t, p in zip(graph.logit_tokens.tolist(), graph.logit_probabilities.tolist())],
               "max_feature_nodes": args.max_feature_nodes, "max_memory_bytes": bound,
               "replacement_score": replacement_score, "completeness_score": completeness, "live_mlp_layers": live,
               "attribute_seconds": round(seconds, 3), "device": device, "peak_memory": memory.record(),
               "intervention": record, "files": sorted([*names, "attribution.json"])}
    atomic_write_text(out / "attribution.json", json.dumps(summary, indent=1, ensure_ascii=False))
    bar.advance()
    return summary


def _print_summary(args: argparse.Namespace, summary: dict[str, Any], several: bool) -> None:
    """Print one prompt's counts, scores, logits, interventions, peak memory and files."""
    folder = Path(args.out) / summary["folder"] if several else Path(args.out)
    if several:
        print(f"{summary['folder']}: {summary['prompt']!r}")
    print(f"{summary['features']} of {summary['active_features']} active features, {summary['nodes']} nodes; "
          f"replacement score {summary['replacement_score']:.3f}, completeness {summary['completeness_score']:.3f}")
    if summary["live_mlp_layers"]:
        print(f"  MLP layers without a transcoder (left live, outside the graph): {summary['live_mlp_layers']}")
    for logit in summary["logits"]:
        print(f"  logit {logit['text']!r} p={logit['probability']:.3f}")
    record = summary["intervention"]
    if record is not None:
        for edit in record["edits"]:
            print(f"  {edit['kind']} layer {edit['layer']} position {edit['position']} feature {edit['feature']} "
                  f"(a={edit['activation']:.4g})")
        for side in ("top_before", "top_after"):
            print(f"  {side}: " + ", ".join(f"{t['text']!r} {t['probability']:.3f}" for t in record[side][:5]))
    memory = summary["peak_memory"]
    print(f"  attribute {summary['attribute_seconds']:.1f} s; peak memory {memory['peak_gib']:.3f} GiB "
          f"({memory['kind']}{'' if args.max_memory is None else f', bound {args.max_memory}'})")
    for name in summary["files"]:
        print(f"wrote {folder / name}")


def _process_max_rss() -> int:
    """The process's peak resident size since it started, in bytes (``getrusage``)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


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
    p.add_argument("--prompt", action="append", default=[], metavar="TEXT",
                   help="the prompt (tokenized as the tokenizer does); repeat it for several prompts, each then "
                        "written to OUT/prompt_000/, OUT/prompt_001/, ...")
    p.add_argument("--prompts", default=None, metavar="FILE",
                   help="prompts from a file instead: one a line, or JSON Lines of {\"prompt\": ...}; one folder each "
                        "(OUT/prompt_000/, ...), the model and dictionaries loaded once")
    p.add_argument("--dictionaries", required=True, metavar="DIR",
                   help="layer_<i>/ folders written by save_dictionary, gradpatch fit's output folder (its "
                        "dictionary/<node>/ transcoders, placed by the MLP output each writes), a circuit-tracer "
                        "config.yaml's folder, or a cross-layer transcoder's folder (clt.json, or circuit-tracer's "
                        "W_enc_<i>.safetensors)")
    p.add_argument("--slug", default=None, help="graph.json's metadata.slug, Neuronpedia's name of the graph "
                                                "(letters, digits, _ . -; default: the model, the time and a hash of "
                                                "the prompt, unique per graph)")
    p.add_argument("--scan", default=None, help="graph.json's metadata.scan, Neuronpedia's model id (default: the "
                                                "model folder's name)")
    add_output_options(p, "output folder")
    add_qk_options(p)
    add_model_option(p)
    add_device_option(p)
    p.add_argument("--max-feature-nodes", type=_feature_count, default=7500, metavar="N",
                   help="compute the rows of at most N features, chosen as circuit-tracer does (by influence on the "
                        "logits, in rounds of 4 batches), and keep those; 'all' for every active feature (default "
                        "%(default)s, circuit-tracer's)")
    p.add_argument("--max-memory", default=None, metavar="SIZE",
                   help="bound on what attribution holds beyond the model (e.g. 8GiB, 512MiB): fewer targets per "
                        "backward pass, refused when not even one fits (default: no bound); the peak memory is "
                        "reported either way")
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
