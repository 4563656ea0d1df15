"""``gradpatch eval-edit``: edit the cases of a CounterFact file with ROME, MEMIT or AlphaEdit, in batches and
sequentially, and write the scores.

Usage::

    gradpatch eval-edit --method memit --cases demos/rome/facts.json --batch-size 1000 --out memit.json
    gradpatch eval-edit --method alphaedit --cases demos/rome/facts.json --batch-size 100 --sequential 10 \\
        --n-cases 1000 --out alphaedit.json
    gradpatch eval-edit --method rome --cases demos/rome/cases.json --out rome.json

The first ``--n-cases`` cases (after the first ``--skip-cases``, left out) are cut into batches of ``--batch-size``
facts; ``--sequential K`` batches are applied one after another (each computed on the model the earlier ones left)
before the group's cases are scored and the weights restored
(:func:`editors.evaluation.sequential.evaluate_sequential`). ROME edits a batch's facts one by one (rank-one edits,
the plain-torch value runner); MEMIT and AlphaEdit a batch at once. The JSON has ``eval-rome``'s fields
(``efficacy_score``, ``paraphrase_score``, ``neighborhood_score``, ``n_cases``, ``pre``, ``cases``) plus ``forms``
(per prompt form of a suite's ``form_prompts``, :mod:`editors.evaluation.forms`: ``score``, ``pre``, ``n``), ``batches``,
``seconds_per_batch`` and ``neighborhood_prompts_left_out`` (neighbourhood prompts naming a subject edited in the same
group are not scored). Every text is edited and scored after the editor's start token (``--start-token``; the
editor's ``tokenizer``), which ``settings.start_token`` records. The JSON carries a ``provenance`` record (the command
line, every option, the versions; :mod:`recipes.cli.outputs`); an ``--out`` file that exists is refused unless
``--overwrite`` is given.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from editors import DEFAULT_MOM2_RELATIVE_WEIGHT, DEFAULT_SMOLLM2_NODE, DEFAULT_SMOLLM2_NODES, METHODS

from .options import add_edit_options, start_token_setting, usage_error
from .outputs import add_output_options, earlier_run, write_json_output

__all__ = ["NAME", "add_evaluation_options", "evaluate_edits", "register", "run_eval_edit", "settings_used",
           "write_metrics"]

NAME = "eval-edit"


def _nodes(args: argparse.Namespace, command: str) -> list[str] | None:
    """The NodePaths to edit (``--nodes``, or the embedded model's defaults), ``None`` with the fix printed."""
    if args.nodes or args.node:
        nodes = [n.strip() for n in (args.nodes or args.node).split(",") if n.strip()]
    elif args.model is not None:
        usage_error(command, "--model needs --nodes (or --node), the NodePaths of the linear layers to edit "
                             "(comma-separated), e.g. model.layers_2.mlp.down_proj,model.layers_3.mlp.down_proj; "
                             "`gradpatch graph --model PATH` prints the node tree")
        return None
    else:
        nodes = [DEFAULT_SMOLLM2_NODE] if args.method == "rome" else list(DEFAULT_SMOLLM2_NODES)
    if args.method == "rome" and len(nodes) != 1:
        usage_error(command, f"ROME edits one layer; got {len(nodes)} in --nodes")
        return None
    return nodes


def run_eval_edit(args: argparse.Namespace) -> int:
    """Run ``eval-edit`` (see the module docstring); returns the exit status."""
    result = evaluate_edits(args)
    return result if isinstance(result, int) else write_metrics(args, result)


def evaluate_edits(args: argparse.Namespace) -> dict[str, Any] | int:
    """The evaluation ``eval-edit`` runs (and ``eval-rome``, its alias with ``--method rome``): the options checked
    before the model is loaded, then :func:`editors.evaluate_sequential` with the method's editor.

    Returns:
        The JSON record (see the module docstring), or 2 after printing a usage error that names the fix.
    """
    from editors import config_for, editable_graph, editor_for, evaluate_sequential, load_cases
    from gradpatch.files.loaders import default_device, load_model

    command = getattr(args, "command", None) or NAME
    nodes = _nodes(args, command)
    if nodes is None:
        return 2
    problem = earlier_run(args)
    if problem:
        return usage_error(command, problem)
    if args.batch_size < 1 or args.sequential < 1:
        return usage_error(command, "--batch-size and --sequential must be at least 1")
    if args.preserve is not None and args.method == "rome":
        return usage_error(command, "--preserve applies to MEMIT and AlphaEdit; drop it for ROME")
    if args.nullspace_threshold is not None and args.method != "alphaedit":
        return usage_error(command, f"--nullspace-threshold is AlphaEdit's; drop it for {args.method} or add "
                                    f"--method alphaedit")
    if args.value_at_subject and args.method != "rome":
        return usage_error(command, "--value-at-subject applies to ROME (MEMIT's batched search adds δ at the subject "
                                    "already); drop it or add --method rome")
    if args.true_logit_weight and args.method == "rome":
        return usage_error(command, "--true-logit-weight applies to MEMIT and AlphaEdit; drop it for ROME")
    if args.skip_cases < 0:
        return usage_error(command, f"--skip-cases must be 0 or more, got {args.skip_cases}")
    if not args.preserve_weight > 0:
        return usage_error(command, f"--preserve-weight must be positive, got {args.preserve_weight:g}")
    try:
        config = config_for(args.method, **_settings(args))
        cases = load_cases(args.cases)
        preserved = _preserved_facts(args.preserve) if args.preserve is not None else []
    except (OSError, ValueError) as error:
        return usage_error(command, error)
    if args.skip_cases >= len(cases):
        return usage_error(command, f"--skip-cases {args.skip_cases} leaves none of the {len(cases)} cases of "
                                    f"{args.cases}; give a smaller number")
    cases = cases[args.skip_cases:]
    if args.n_cases is not None:
        cases = cases[: args.n_cases]
    t0 = time.perf_counter()
    model, tokenizer = load_model(args.model, device=args.device or default_device())
    pg = editable_graph(model, tokenizer)
    t1 = time.perf_counter()
    try:
        editor = editor_for(args.method, pg, tokenizer, nodes, config, corpus=args.corpus)
    except ValueError as error:  # a --start-token the tokenizer has not
        return usage_error(command, error)
    statistics = editor.layer_statistics()
    if preserved:
        editor.preserve(preserved, weight=args.preserve_weight)  # type: ignore[attr-defined]
    editor.templates()
    t2 = time.perf_counter()
    result = evaluate_sequential(pg, editor.tokenizer, cases, editor.applier(), batch_size=args.batch_size,
                                 sequential=args.sequential, after_group=editor.forget, progress=not args.quiet)
    t3 = time.perf_counter()
    return {key: result[key] for key in ("efficacy_score", "paraphrase_score", "neighborhood_score", "n_cases",
                                         "pre", "forms", "neighborhood_prompts_left_out")} | {
        "method": args.method,
        "nodes": nodes,
        "model": args.model or "embedded:SmolLM2-135M-Instruct",
        "cases_file": str(args.cases),
        "config": editor.config.to_json(),
        "settings": settings_used(editor.config.to_json(), result["batches"]) | {"start_token": editor.start_token},
        "preserved": {"file": args.preserve, "n_facts": len(preserved), "weight": args.preserve_weight}
        if preserved else None,
        "statistics": [{"node": s.input_node, "n_tokens": s.n_tokens, "n_samples": s.n_samples, "corpus": s.corpus}
                       for s in statistics],
        "seconds": {"load": t1 - t0, "statistics_and_templates": t2 - t1, "load_and_statistics": t2 - t0,
                    "evaluation": t3 - t2},
    } | {key: result[key] for key in ("batch_size", "sequential", "seconds_per_batch", "batches", "cases")}


def write_metrics(args: argparse.Namespace, result: dict[str, Any]) -> int:
    """Write ``result`` with its provenance to ``--out`` (atomically) and print the scores; returns 0.

    Raises:
        OutputExistsError: ``--out`` came to exist during the run and ``--overwrite`` was not given.
    """
    out = write_json_output(args, result)
    print(f"{args.method}: efficacy {result['efficacy_score']:.3f}  paraphrase {result['paraphrase_score']:.3f}  "
          f"neighborhood {result['neighborhood_score']:.3f}  ({result['n_cases']} cases; before the edits "
          f"{result['pre']['efficacy_score']:.3f} / {result['pre']['paraphrase_score']:.3f} / "
          f"{result['pre']['neighborhood_score']:.3f}) -> {out}")
    for name, form in result.get("forms", {}).items():
        print(f"  form {name}: {_score(form['score'])} ({form['n']} cases; before the edits {_score(form['pre'])})")
    return 0


def _score(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    """The method's configuration fields the options set (:func:`editors.config_for`); the others keep the
    configuration's defaults."""
    settings: dict[str, Any] = {"n_samples": args.n_samples, "steps": args.steps, "cache_dir": args.cache_dir,
                                "progress": not args.quiet, "allow_unconverged": True} | start_token_setting(args)
    settings |= {name: getattr(args, name) for name in ("keys_per_context", "subject_first_key", "kl_in_context",
                                                        "early_stop_loss")
                 if getattr(args, name) is not None}  # given: on or off; not given: the method's default
    if args.method == "rome":
        return settings | {"value_through_update": not args.value_at_subject}
    settings |= {"mom2_update_weight": args.mom2_update_weight, "mom2_relative_weight": args.mom2_relative_weight,
                 "value_dtype": args.value_dtype, "true_logit_weight": args.true_logit_weight}
    if args.nullspace_threshold is not None:
        settings["nullspace_threshold"] = args.nullspace_threshold
    return settings


def settings_used(config: dict[str, Any], batches: list[dict[str, Any]]) -> dict[str, Any]:
    """The settings a score depends on, as resolved: the keys' mode and, for MEMIT, ``λ`` per edited layer and batch
    (``"rule"`` ``"absolute"``: ``--mom2-update-weight``; ``"relative"``: ``--mom2-relative-weight`` times the edited
    keys' mean ``kᵀC⁻¹k``). ``config`` is the editor's :meth:`~editors.config.ROMEConfig.to_json`, ``batches`` the
    records of :func:`editors.evaluation.sequential.evaluate_sequential`."""
    keys = "per context" if config["keys_per_context"] else "averaged over the context prefixes (k*)"
    if config.get("subject_first_key"):
        keys += ", plus the subject at the start of the text"
    settings: dict[str, Any] = {"keys": keys}
    weights: dict[str, list[float]] = {}
    for batch in batches:
        for layer in batch.get("layers", []):
            if layer.get("mom2_update_weight") is not None:
                weights.setdefault(layer["node"], []).append(layer["mom2_update_weight"])
    if weights:
        absolute = config["mom2_update_weight"] is not None
        settings["mom2_update_weight"] = {"rule": "absolute" if absolute else "relative",
                                          "relative_weight": None if absolute else config["mom2_relative_weight"],
                                          "per_layer_per_batch": weights}
    return settings


def _preserved_facts(path: str) -> list[tuple[str, str]]:
    """The ``(prompt, subject)`` pairs of a ``--preserve`` file: a JSON list of ``{"prompt": "... {} ...",
    "subject": ...}`` records (other keys are ignored), e.g. ``demos/rome/preserve.json``.

    Raises:
        OSError: the file cannot be read.
        ValueError: it is not such a list (the first bad record is named).
    """
    records = json.loads(Path(path).read_text(encoding="utf-8"))
    if not isinstance(records, list) or not records:
        raise ValueError(f"{path}: expected a non-empty JSON list of {{\"prompt\", \"subject\"}} records")
    facts = []
    for i, record in enumerate(records):
        prompt = record.get("prompt") if isinstance(record, dict) else None
        subject = record.get("subject") if isinstance(record, dict) else None
        if not isinstance(prompt, str) or "{}" not in prompt or not isinstance(subject, str) or not subject:
            raise ValueError(f"{path}: record {i} needs a \"prompt\" with {{}} where the subject goes and a "
                             f"\"subject\", got {record!r}")
        facts.append((prompt, subject))
    return facts


def register(subparsers: Any) -> None:
    """Add the ``eval-edit`` parser to the ``gradpatch`` sub-parsers."""
    p = subparsers.add_parser(
        NAME,
        help="edit CounterFact cases with ROME, MEMIT or AlphaEdit in (sequential) batches and write the scores",
        description="Cut the cases into batches, apply --sequential batches one after another, score the group's "
                    "cases after all of them, restore the weights; repeat.",
    )
    p.add_argument("--method", required=True, choices=METHODS, help="the editing algorithm")
    add_evaluation_options(p)
    p.set_defaults(func=run_eval_edit)


def add_evaluation_options(p: argparse.ArgumentParser) -> None:
    """Add every ``eval-edit`` option but ``--method`` (``eval-rome`` takes them all, its method fixed to ROME)."""
    p.add_argument("--cases", required=True, metavar="FILE.json", help="CounterFact-format JSON list")
    add_output_options(p, "where to write the scores", metavar="METRICS.json")
    p.add_argument("--nodes", default=None, metavar="N1,N2,...",
                   help="comma-separated NodePaths of the edited linear layers (default for the embedded model: "
                        "ROME's layer 3, MEMIT/AlphaEdit's layers 2-6 down_proj)")
    p.add_argument("--batch-size", type=int, default=1, metavar="N", help="facts per batch (default %(default)s)")
    p.add_argument("--sequential", type=int, default=1, metavar="K",
                   help="batches applied one after another before scoring (default %(default)s)")
    p.add_argument("--n-cases", type=int, default=None, metavar="N", help="only the first N cases")
    p.add_argument("--skip-cases", type=int, default=0, metavar="M",
                   help="leave out the file's first M cases (before --n-cases; default %(default)s)")
    p.add_argument("--mom2-update-weight", type=float, default=None, metavar="λ",
                   help="MEMIT's λ (eq. 14) as an absolute number, e.g. 15000 (the reference code's for GPT-J); "
                        "default: relative to the statistics (--mom2-relative-weight)")
    p.add_argument("--mom2-relative-weight", type=float, default=DEFAULT_MOM2_RELATIVE_WEIGHT, metavar="A",
                   help="MEMIT's λ at each layer as A times the edited keys' mean kᵀC⁻¹k (the same A carries across "
                        "models; default %(default)s); ignored with --mom2-update-weight")
    p.add_argument("--nullspace-threshold", type=float, default=None, help="AlphaEdit's eigenvalue threshold")
    p.add_argument("--keys-per-context", action=argparse.BooleanOptionalAction, default=None,
                   help="solve for every context prompt's key instead of their average (default: the method's, on "
                        "for ROME, off for MEMIT and AlphaEdit)")
    p.add_argument("--subject-first-key", action=argparse.BooleanOptionalAction, default=None,
                   help="also solve for the key of the subject at the start of the text, where prompts that begin "
                        "with the subject have it (default: the method's, on for ROME, MEMIT and AlphaEdit)")
    p.add_argument("--kl-in-context", action=argparse.BooleanOptionalAction, default=None,
                   help="read the value search's KL prompt (\"{subject} is a\") behind the first non-empty context "
                        "prefix instead of at the start of the text (default: the method's, on for ROME, off for "
                        "MEMIT and AlphaEdit)")
    p.add_argument("--value-at-subject", action="store_true",
                   help="ROME: search the value with δ added at the subject's last token (the paper's search) instead "
                        "of through the rank-one update the edit writes (the default; docs/rome.md)")
    p.add_argument("--value-dtype", default=None, choices=("bfloat16", "float16", "float32"),
                   help="MEMIT/AlphaEdit: run the batched value search on a copy of the model in this dtype "
                        "(bfloat16 on a float32 model on CPU: faster; default: the model itself)")
    p.add_argument("--preserve", default=None, metavar="FILE.json",
                   help="MEMIT/AlphaEdit: subjects whose keys every update keeps (MEMIT.preserve): a JSON list of "
                        "{\"prompt\": \"... {} ...\", \"subject\": ...}, e.g. demos/rome/preserve.json")
    p.add_argument("--preserve-weight", type=float, default=1.0, metavar="W",
                   help="weight of each preserved key against one edited fact's (default %(default)s)")
    p.add_argument("--true-logit-weight", type=float, default=0.0, metavar="λ",
                   help="MEMIT/AlphaEdit: weight of a value-search term that keeps each fact's true-answer logit "
                        "from falling (not in the papers; 0.5 raised AlphaEdit's neighbourhood score on the "
                        "development facts, docs/memit.md; default %(default)s: the papers' objective)")
    p.add_argument("--early-stop-loss", type=float, default=None, metavar="L",
                   help="a fact's value search stops once its loss is below L (default: the method's, 0.05; "
                        "AlphaEdit's 0.15)")
    add_edit_options(p)
    p.add_argument("--quiet", action="store_true", help="no progress output")
