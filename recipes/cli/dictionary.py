"""``gradpatch dictionary eval``: a saved SAE or transcoder spliced into a model, scored as the field scores it.

::

    gradpatch dictionary eval --dictionary runs/sae/dictionary --out runs/sae/eval
    gradpatch dictionary eval --dictionary sae_dir --format saelens --node model.layers_12.output \\
        --corpus texts.jsonl --tokens 8192 --max-length 128 --out eval/

Writes ``OUT/metrics.json`` (:func:`recipes.dictionary.metrics.write_dictionary_metrics`: ``{"dictionaries": {node:
metrics}}``, the metrics FVU, explained variance, L0, dead fraction, the original, spliced and zero-ablated CE losses,
CE loss recovered, KL, tokens, and the CE losses, score and KL under SAELens's names too) over the first
``--tokens`` tokens of the corpus: a ``.txt`` file is one document per line, a ``.jsonl`` file its ``text`` field,
the default the offline English Wikipedia summaries; each document tokenized as the tokenizer does by default and
truncated to ``--max-length``. The dictionary is spliced without its error term, after the first
``--exclude-first-positions`` positions of each document (default: its config's ``exclude_first_positions``). Bad
input (a missing folder, a folder of another format, a NodePath the graph lacks, a width that does not fit the node,
a dictionary saved for another model, a negative ``--exclude-first-positions``, an ``--out`` that holds an earlier
run without ``--overwrite``) exits with status 2 and writes nothing. ``metrics.json`` carries a ``provenance`` record
(the command line, every option: the dictionary, its format and nodes, the model, the corpus; the versions) and
``OUT/provenance.json`` lists the files (:mod:`recipes.cli.outputs`); an earlier run in ``--out`` is replaced whole.
A progress bar on stderr counts the documents scored (off with ``--quiet``).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .options import add_device_option, add_model_option, other_model_error, usage_error
from .outputs import add_output_options, earlier_run, staged_folder

if TYPE_CHECKING:
    from gradpatch.progress import ProgressBar
    from torch.utils.hooks import RemovableHandle

__all__ = ["NAME", "register"]

NAME = "dictionary"
_EVAL = f"{NAME} eval"
FORMATS = ("gradpatch", "saelens", "sparsify")
#: Each ``--format``'s files: the first one tells the layout apart.
_LAYOUTS = {"gradpatch": ("dictionary.json", "dictionary.safetensors"),
            "saelens": ("sae_weights.safetensors", "cfg.json"), "sparsify": ("sae.safetensors", "cfg.json")}


def _layout_error(args: argparse.Namespace) -> str | None:
    """The usage error of a ``--dictionary`` folder in another layout than ``--format`` says, naming the flag to give
    (the loaders' own messages name Python functions), else ``None``."""
    folder = Path(args.dictionary)
    found = next((name for name, files in _LAYOUTS.items() if (folder / files[0]).is_file()), None)
    if found is None or found == args.format:
        return None
    node = "" if found == "gradpatch" or args.node else " --node NODEPATH"
    return (f"--dictionary {folder} holds {found}'s files ({' + '.join(_LAYOUTS[found])}), not {args.format}'s "
            f"({' + '.join(_LAYOUTS[args.format])}); give --format {found}{node}")


def _count_documents(pg: Any, bar: ProgressBar) -> RemovableHandle:
    """Advance ``bar`` once per document ``pg`` is run on: the forward passes of one document share its ``input_ids``
    tensor. Returns the hook's handle (``remove()`` it after)."""
    last: list[Any] = [None]

    def hook(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is not last[0]:
            last[0] = ids
            bar.advance()

    return pg.register_forward_pre_hook(hook, with_kwargs=True)


def _load(args: argparse.Namespace, model: Any) -> Any:
    """The dictionary of ``--dictionary`` in ``--format`` (ours checked against ``model``'s fingerprint)."""
    from gradpatch.dictionaries import load_dictionary, load_saelens, load_sparsify

    if args.format == "saelens":
        return load_saelens(args.dictionary, node=args.node, output_node=args.output_node)
    if args.format == "sparsify":
        return load_sparsify(args.dictionary, node=args.node, output_node=args.output_node)
    return load_dictionary(args.dictionary, model=model)


def _with_excluded_positions(dictionary: Any, count: int | None) -> Any:
    """``dictionary`` with its config's ``exclude_first_positions`` set to ``count`` (unchanged for ``None``).

    Raises:
        DictionaryConfigError: a negative ``count``.
    """
    if count is not None:
        dictionary.config = dataclasses.replace(dictionary.config, exclude_first_positions=count)
    return dictionary


def _run_eval(args: argparse.Namespace) -> int:
    """Run ``gradpatch dictionary eval`` (see the module docstring); returns the exit status."""
    if not Path(args.dictionary).is_dir():
        return usage_error(_EVAL, f"--dictionary {args.dictionary} is not a folder (give the folder holding the "
                                  f"dictionary's files)")
    problem = _layout_error(args) or earlier_run(args)
    if problem:
        return usage_error(_EVAL, problem)

    import torch

    from gradpatch import PatchableGraph
    from gradpatch.errors import FingerprintMismatchError, GradpatchError
    from gradpatch.files.loaders import default_device, load_model
    from gradpatch.progress import ProgressBar

    from ..dictionary.corpus import read_documents, tokenize_documents
    from ..dictionary.metrics import write_dictionary_metrics

    try:
        device = args.device or default_device()
        model, tokenizer = load_model(args.model, device=device)
        dictionary = _with_excluded_positions(_load(args, model), args.exclude_first_positions)
        documents, _ = tokenize_documents(tokenizer, read_documents(args.corpus), args.tokens, args.max_length)
        if not documents:
            return usage_error(_EVAL, f"the corpus {args.corpus or '(the Wikipedia summaries)'} gave no document of "
                                      f"2 tokens or more")
        with torch.no_grad():  # built on one document: the graph every [1, length] pass uses (no second extraction)
            pg = PatchableGraph(model, torch.tensor([documents[0]], device=device), use_cache=False).eval()
        with ProgressBar(_EVAL, unit="doc", total=len(documents), enabled=not args.quiet) as bar, \
                staged_folder(args) as folder:
            counting = _count_documents(pg, bar)
            try:
                (metrics,) = write_dictionary_metrics(pg, dictionary, documents, folder, node=args.node,
                                                      output_node=args.output_node).values()
            finally:
                counting.remove()
    except FingerprintMismatchError:
        return usage_error(_EVAL, other_model_error("--dictionary", args.dictionary, args.model))
    except (GradpatchError, FileNotFoundError) as error:  # OutputExistsError is a GradpatchError
        return usage_error(_EVAL, error)
    summary = ", ".join(f"{key} {value:.4g}" for key, value in dataclasses.asdict(metrics).items())
    print(f"gradpatch {_EVAL}: {summary} -> {Path(args.out) / 'metrics.json'}", file=sys.stderr)
    return 0


def register(subparsers: Any) -> None:
    """Add the ``dictionary`` parser (sub-command ``eval``) to the ``gradpatch`` sub-parsers."""
    p = subparsers.add_parser(NAME, help="sparse dictionaries (SAEs, transcoders): evaluate a saved one",
                              description="Commands on sparse dictionaries; see docs/dictionaries.md.")
    commands = p.add_subparsers(dest="dictionary_command", metavar="COMMAND", required=True)
    e = commands.add_parser(
        "eval", help="FVU, L0, dead fraction, CE loss recovered and KL of a spliced dictionary -> metrics.json",
        description="Splice a saved dictionary (without its error term) and write OUT/metrics.json, "
                    "{\"dictionaries\": {node: metrics}}: fvu, explained_variance, l0, dead_fraction, "
                    "ce_loss_original, ce_loss_spliced, ce_loss_zero_ablation, ce_loss_recovered, kl, n_tokens, and "
                    "SAELens's ce_loss_without_sae, ce_loss_with_sae, ce_loss_with_ablation, ce_loss_score, "
                    "kl_div_with_sae.")
    e.add_argument("--dictionary", required=True, metavar="DIR", help="the dictionary's folder")
    e.add_argument("--format", default="gradpatch", choices=FORMATS,
                   help="its layout: ours (dictionary.json), SAELens's (cfg.json + sae_weights.safetensors) or "
                        "sparsify's (cfg.json + sae.safetensors) (default %(default)s)")
    e.add_argument("--node", default=None, metavar="NODEPATH",
                   help="NodePath read (and an SAE's written); needed for saelens and sparsify, which record no "
                        "NodePath (default: the one saved with ours)")
    e.add_argument("--output-node", default=None, metavar="NODEPATH",
                   help="a transcoder's NodePath written (default: the one saved with ours)")
    add_model_option(e)
    add_device_option(e)
    e.add_argument("--corpus", default=None, metavar="FILE",
                   help=".txt (one document per line) or .jsonl ('text' field) (default: the offline English "
                        "Wikipedia summaries)")
    e.add_argument("--tokens", type=int, default=4096, metavar="N", help="tokens scored (default %(default)s)")
    e.add_argument("--max-length", type=int, default=128, metavar="L",
                   help="tokens per document at most (default %(default)s)")
    e.add_argument("--exclude-first-positions", type=int, default=None, metavar="N",
                   help="leave the first N positions of every document unspliced and unscored (attention sinks; "
                        "default: the dictionary's own setting, 0 for SAELens's and sparsify's files)")
    add_output_options(e, "folder of metrics.json")
    e.add_argument("--quiet", action="store_true", help="no progress bar")
    e.set_defaults(func=_run_eval)
