"""Options shared by the ``gradpatch`` commands, and how a command reports a usage error.

Nothing here imports torch: defaults come from :mod:`editors.defaults` and :mod:`editors.config`.
"""

from __future__ import annotations

import argparse
import sys

from editors import DEFAULT_SMOLLM2_NODE, ROMEConfig

__all__ = ["add_device_option", "add_edit_options", "add_model_option", "other_model_error", "start_token_setting",
           "start_token_value", "usage_error"]


def add_model_option(p: argparse.ArgumentParser) -> None:
    """Add ``--model PATH`` (a ``save_pretrained`` folder or a ``.gguf`` file; default: the embedded model)."""
    p.add_argument("--model", metavar="PATH", default=None,
                   help="save_pretrained directory or .gguf file (default: the embedded SmolLM2-135M-Instruct)")


def add_device_option(p: argparse.ArgumentParser) -> None:
    """Add ``--device`` (default: cuda when available, else cpu; see :func:`gradpatch.files.loaders.default_device`)."""
    p.add_argument("--device", default=None, help="torch device (default: cuda when available, else cpu)")


def add_edit_options(p: argparse.ArgumentParser) -> None:
    """Add ``--model``, ``--node``, ``--device`` and the ROME settings ``--corpus``, ``--n-samples``, ``--steps``,
    ``--cache-dir``, ``--start-token`` (defaults: :class:`editors.config.ROMEConfig`'s; read ``--start-token`` with
    :func:`start_token_setting`)."""
    defaults = ROMEConfig()
    add_model_option(p)
    p.add_argument("--node", default=None, metavar="NODEPATH",
                   help=f"linear layer to edit (default for the embedded model: {DEFAULT_SMOLLM2_NODE}; "
                        "needed with --model, e.g. transformer.h_17.mlp.c_proj for GPT-2 XL)")
    add_device_option(p)
    p.add_argument("--corpus", default=None, metavar="FILE",
                   help="text corpus for the second moment (default: the offline English Wikipedia summaries)")
    p.add_argument("--n-samples", type=int, default=defaults.n_samples, help="corpus documents (default %(default)s)")
    p.add_argument("--steps", type=int, default=defaults.steps,
                   help="maximum value-optimisation steps (default %(default)s)")
    p.add_argument("--cache-dir", default=None, help="statistics cache (default ~/.cache/gradpatch/stats)")
    p.add_argument("--start-token", default=None, metavar="TOKEN",
                   help="token put before every text the editor reads and scores: 'auto' (<|endoftext|> if the "
                        "vocabulary has it, else the BOS token), a token, or 'none' (default: the method's, 'auto' "
                        "for ROME, MEMIT and AlphaEdit)")


def start_token_value(text: str) -> str | None:
    """A ``--start-token`` value as the editors' ``start_token`` setting: ``none`` (any case) is ``None``, anything
    else (``auto``, a token) as given."""
    return None if text.lower() == "none" else text


def start_token_setting(args: argparse.Namespace) -> dict[str, str | None]:
    """``{"start_token": ...}`` for the editor's configuration when ``--start-token`` was given
    (:func:`start_token_value`), else ``{}`` (the method's default)."""
    if args.start_token is None:
        return {}
    return {"start_token": start_token_value(args.start_token)}


def usage_error(command: str, error: BaseException | str) -> int:
    """Print ``gradpatch COMMAND: error`` to stderr; returns 2, the exit status of a usage error."""
    message = error.args[0] if isinstance(error, KeyError) and error.args else error  # KeyError quotes its str()
    print(f"gradpatch {command}: {message}", file=sys.stderr)
    return 2


def other_model_error(option: str, folder: str, model: str | None) -> str:
    """The usage error of a dictionary under ``option folder`` saved for another model than ``--model`` (the library's
    :class:`~gradpatch.errors.FingerprintMismatchError` names its Python argument instead of a flag)."""
    return (f"{option} {folder} was saved for another model than --model {model or '(the embedded model)'} (their "
            f"fingerprints differ); give the --model it was trained on")
