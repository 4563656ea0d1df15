"""``gradpatch fit``: train a :class:`~recipes.delta.DeltaModule` from a YAML config with LightningCLI.

::

    gradpatch fit --config recipes/configs/steer_eiffel.yaml
    gradpatch fit --config recipes/configs/steer_eiffel.yaml --trainer.max_steps 10 --model.lr 0.2
    gradpatch fit --config recipes/configs/steer_sentiment.yaml --model path/to/model_dir_or.gguf
    gradpatch fit --help

Everything after ``fit`` goes to LightningCLI (``--config``, ``--print_config``, ``--trainer.*``, ``--model.*``,
``--seed_everything``). ``--model PATH`` with a ``.gguf`` file or a model directory is shorthand for
``--model.model_path PATH``; without it the embedded SmolLM2-135M-Instruct is used. After training, the
intervention is exported (safetensors + JSON) to ``--export`` (default: ``<log_dir>/intervention``).

A config with a ``data:`` section (or ``--data.*`` arguments) trains interchange interventions instead
(:mod:`recipes.cli.fit_interchange`: InterventionModule on counterfactual JSONL, ``recipes/configs/das_country.yaml``);
one whose ``data.class_path`` is a ContinuationDataModule or PreferenceDataModule trains ReFT patches or BiPO
steering vectors (:mod:`recipes.cli.fit_reft`: ReFTModule, ``recipes/configs/loreft_country.yaml``,
``bipo_sentiment.yaml``); one whose ``model:`` has a ``dictionary:`` section trains a sparse autoencoder or
transcoder (:mod:`recipes.cli.fit_dictionary`: DictionaryFitModule, ``recipes/configs/sae_smollm2.yaml``).
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .options import usage_error

__all__ = ["NAME", "TRAINER_DEFAULTS", "register", "run_fit", "translate_model_shortcut"]

NAME = "fit"

#: Trainer settings used unless the config or the command line says otherwise.
TRAINER_DEFAULTS: dict[str, Any] = {
    "max_steps": 50,
    "log_every_n_steps": 1,
    "enable_model_summary": False,
    "logger": {"class_path": "lightning.pytorch.loggers.TensorBoardLogger",
               "init_args": {"save_dir": "runs", "name": "fit"}},
}

_DESCRIPTION = ("Train AddPatch deltas at NodePaths of a frozen causal LM (DeltaModule) from a YAML config; "
                "see recipes/configs/ and docs/recipes.md. Without --model.model_path (or --model PATH) the "
                "embedded SmolLM2-135M-Instruct is used.")


def translate_model_shortcut(args: Sequence[str]) -> list[str]:
    """Rewrite ``--model PATH`` (``--model=PATH``) to ``--model.model_path PATH`` when ``PATH`` is a ``.gguf`` file or
    a model directory; ``--model CONFIG.yaml`` (LightningCLI's own meaning) is left as it is.

    Args:
        args: the arguments after ``fit``.

    Returns:
        The arguments to give LightningCLI.
    """
    out: list[str] = []
    items = list(args)
    i = 0
    while i < len(items):
        item = items[i]
        value: str | None = None
        if item == "--model" and i + 1 < len(items):
            value, step = items[i + 1], 2
        elif item.startswith("--model="):
            value, step = item.split("=", 1)[1], 1
        if value is not None and _is_model_path(value):
            out += ["--model.model_path", value]
            i += step
            continue
        out.append(item)
        i += 1
    return out


def _is_model_path(value: str) -> bool:
    path = Path(value).expanduser()
    return path.suffix.lower() == ".gguf" or path.is_dir()


def run_fit(args: Sequence[str]) -> int:
    """Parse ``args`` with LightningCLI, train, export the intervention.

    Args:
        args: the arguments after ``fit`` (``--config FILE``, ``--trainer.max_steps N``, ...); a config with a
            ``data:`` section goes to :func:`recipes.cli.fit_interchange.run_interchange_fit` (or the ReFT or
            dictionary paths, see the module docstring).

    Returns:
        0 on success; 2 when the config names a NodePath the model lacks, a corpus or data file that is missing or
        too short, or another bad setting (the error is printed before Lightning writes anything); 1 when training
        stopped at a non-finite loss term, gradient or delta (the error is printed and nothing is exported).
        ``--help`` and argument errors exit through ``SystemExit``, as LightningCLI does.
    """
    from .fit_dictionary import is_dictionary_config, run_dictionary_fit
    from .fit_interchange import is_interchange_config, run_interchange_fit
    from .fit_reft import is_reft_config, run_reft_fit

    if is_dictionary_config(args):
        return run_dictionary_fit(translate_model_shortcut(args))
    if is_reft_config(args):
        return run_reft_fit(args)
    if is_interchange_config(args):
        return run_interchange_fit(args)
    from lightning.pytorch.cli import LightningCLI
    from lightning.pytorch.loggers import TensorBoardLogger

    from gradpatch.errors import GradpatchError, NonFiniteError

    from ..delta import DeltaModule
    from ..reports import InterventionLogger

    class DeltaCLI(LightningCLI):
        """LightningCLI for DeltaModule with an ``--export`` folder."""

        def add_arguments_to_parser(self, parser: Any) -> None:
            parser.add_argument("--export", type=str | None, default=None,
                                help="folder for the trained intervention (default: <log_dir>/intervention)")

    os.environ.setdefault("JSONARGPARSE_DEPRECATION_WARNINGS", "off")  # raised by Lightning's own calls
    warnings.filterwarnings("ignore", message=r".*does not have many workers.*")  # prompts are tokenized upfront
    warnings.filterwarnings("ignore", message=r"LightningCLI's args parameter")  # we pass the args after 'fit'
    try:  # the module loads the model and checks its NodePaths: a bad one is refused before Lightning writes
        cli = DeltaCLI(
            DeltaModule,
            run=False,
            auto_configure_optimizers=False,  # DeltaModule.configure_optimizers sees the deltas only
            args=translate_model_shortcut(args),
            trainer_defaults=TRAINER_DEFAULTS,
            seed_everything_default=0,
            save_config_kwargs={"overwrite": True},
            parser_kwargs={"prog": "gradpatch fit", "description": _DESCRIPTION, "default_env": False},
        )
    except (GradpatchError, FileNotFoundError) as error:
        return usage_error(NAME, error)
    trainer, module = cli.trainer, cli.model
    if any(isinstance(lg, TensorBoardLogger) for lg in trainer.loggers) and not any(
            isinstance(cb, InterventionLogger) for cb in trainer.callbacks):
        trainer.callbacks.append(InterventionLogger())
    try:
        trainer.fit(module)
    except NonFiniteError as error:
        print(f"gradpatch {NAME}: {error}", file=sys.stderr)
        return 1
    if trainer.is_global_zero:
        export = cli.config.get("export")
        folder = Path(export) if export else Path(trainer.log_dir or ".") / "intervention"
        module.export_intervention(folder)
        print(f"gradpatch fit: intervention saved to {folder} (Intervention.load(folder, graph=pg) reads it)",
              file=sys.stderr)
    return 0


def _run_fit_command(args: argparse.Namespace) -> int:
    return run_fit(args.lightning_args)


def register(subparsers: Any) -> None:
    """Add the ``fit`` parser to the ``gradpatch`` sub-parsers (every argument after ``fit`` goes to LightningCLI)."""
    p = subparsers.add_parser(
        NAME,
        help="train an intervention (AddPatch deltas) from a YAML config with LightningCLI",
        description=_DESCRIPTION,
        add_help=False,  # --help goes to LightningCLI
        prefix_chars="\0",  # every argument after 'fit' goes to LightningCLI unparsed
    )
    p.add_argument("lightning_args", nargs=argparse.REMAINDER)
    p.set_defaults(func=_run_fit_command)
