"""``gradpatch dictionary eval``: a saved SAE or transcoder spliced into a model, scored as the field scores it.

::

    gradpatch dictionary eval --dictionary runs/sae/dictionary --out runs/sae/eval
    gradpatch dictionary eval --dictionary sae_dir --format saelens --node model.layers_12.output \\
        --corpus texts.jsonl --tokens 8192 --max-length 128 --out eval/

Writes ``OUT/metrics.json`` (:func:`recipes.dictionary.metrics.write_dictionary_metrics`: FVU, explained variance,
L0, dead fraction, the original, spliced and zero-ablated CE losses, CE loss recovered, KL, tokens) over the first
``--tokens`` tokens of the corpus: a ``.txt`` file is one document per line, a ``.jsonl`` file its ``text`` field,
the default the offline English Wikipedia summaries; each document tokenized as the tokenizer does by default and
truncated to ``--max-length``. The dictionary is spliced without its error term, after the first
``--exclude-first-positions`` positions of each document (default: its config's ``exclude_first_positions``). Bad
input (a missing folder, a folder of another format, a NodePath the graph lacks, a width that does not fit the node,
a dictionary saved for another model, a negative ``--exclude-first-positions``) exits with status 2 and writes
nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any

from .options import add_device_option, add_model_option, usage_error

__all__ = ["NAME", "register"]

NAME = "dictionary"
_EVAL = f"{NAME} eval"
FORMATS = ("gradpatch", "saelens", "sparsify")


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
    import torch

    from gradpatch import PatchableGraph
    from gradpatch.errors import GradpatchError
    from gradpatch.files.loaders import default_device, load_model

    from ..dictionary.corpus import read_documents, tokenize_documents
    from ..dictionary.metrics import write_dictionary_metrics

    if not Path(args.dictionary).is_dir():
        return usage_error(_EVAL, f"--dictionary {args.dictionary} is not a folder (give the folder holding the "
                                  f"dictionary's files)")
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
        (metrics,) = write_dictionary_metrics(pg, dictionary, documents, args.out, node=args.node,
                                              output_node=args.output_node).values()
    except (GradpatchError, FileNotFoundError) as error:
        return usage_error(_EVAL, error)
    summary = ", ".join(f"{key} {value:.4g}" for key, value in metrics.to_dict().items())
    print(f"gradpatch {_EVAL}: {summary} -> {Path(args.out) / 'metrics.json'}", file=sys.stderr)
    return 0


def register(subparsers: Any) -> None:
    """Add the ``dictionary`` parser (sub-command ``eval``) to the ``gradpatch`` sub-parsers."""
    p = subparsers.add_parser(NAME, help="sparse dictionaries (SAEs, transcoders): evaluate a saved one",
                              description="Commands on sparse dictionaries; see docs/dictionaries.md.")
    commands = p.add_subparsers(dest="dictionary_command", metavar="COMMAND", required=True)
    e = commands.add_parser(
        "eval", help="FVU, L0, dead fraction, CE loss recovered and KL of a spliced dictionary -> metrics.json",
        description="Splice a saved dictionary (without its error term) and write OUT/metrics.json: fvu, "
                    "explained_variance, l0, dead_fraction, ce_loss_original, ce_loss_spliced, "
                    "ce_loss_zero_ablation, ce_loss_recovered, kl, n_tokens.")
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
    e.add_argument("--out", required=True, metavar="DIR", help="folder of metrics.json")
    e.set_defaults(func=_run_eval)
