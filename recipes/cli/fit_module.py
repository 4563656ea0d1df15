"""What the ``gradpatch fit`` paths for trainable interventions share: the ``--config`` YAML document, and a
LightningCLI run that trains, exports the intervention and writes ``metrics.json`` once, on rank 0."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .options import usage_error

__all__ = ["TRAINER_DEFAULTS", "config_document", "fit_and_export"]

#: Trainer settings used unless the config or the command line says otherwise (``logger: true`` is a
#: TensorBoardLogger under ``default_root_dir``).
TRAINER_DEFAULTS: dict[str, Any] = {"max_steps": 200, "log_every_n_steps": 5, "enable_model_summary": False,
                                    "logger": True, "enable_checkpointing": False}


def config_document(args: Sequence[str]) -> dict[str, Any] | None:
    """The YAML mapping of the ``--config FILE`` (or ``--config=FILE``) among ``args``; ``None`` without one, or
    when the file does not exist or holds no mapping (LightningCLI then reports it)."""
    items = list(args)
    for i, item in enumerate(items):
        path = items[i + 1] if item == "--config" and i + 1 < len(items) else (
            item.split("=", 1)[1] if item.startswith("--config=") else None)
        if path and Path(path).is_file():
            import yaml

            document = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
            return document if isinstance(document, dict) else None
    return None


def fit_and_export(module_class: type, data_class: type, args: Sequence[str], description: str,
                   metrics: Callable[[Any, Any, Path], str], export_name: str = "intervention",
                   trainer_defaults: dict[str, Any] | None = None,
                   prepare: Callable[[Any, Any, Any], None] | None = None, **cli_options: Any) -> int:
    """Parse ``args`` with LightningCLI (``--export FOLDER`` and ``--ckpt_path CKPT`` added), train (resumed from
    ``--ckpt_path`` when given), then on rank 0 export the intervention to
    ``--export`` (default ``<default_root_dir>/<export_name>``) and write the metrics.

    Args:
        module_class: the LightningModule (with ``export_intervention(folder) -> Path``).
        data_class: the LightningDataModule (a base class with ``subclass_mode_data=True`` in ``cli_options``).
        args: the ``gradpatch fit`` arguments.
        description: the ``--help`` text.
        metrics: ``(module, datamodule, root) -> summary`` writes ``root/metrics.json`` and returns one line.
        export_name: the default export folder's name under ``default_root_dir``.
        trainer_defaults: settings over :data:`TRAINER_DEFAULTS` (the config and the command line still win).
        prepare: ``(module, datamodule, trainer)``, run before training: reads and checks the data, so that bad
            data is refused before Lightning writes anything (its errors as the module's).
        cli_options: further LightningCLI arguments.

    Returns:
        0 on success; 2 when the module, the data module or ``prepare`` refuses the config (a NodePath the model
        lacks, a missing or too short corpus: a :class:`gradpatch.GradpatchError` or ``FileNotFoundError``, printed
        before Lightning writes anything); 1 when training stopped at a non-finite value (the error is printed,
        nothing is written).
    """
    from lightning.pytorch.cli import LightningCLI

    from gradpatch.errors import GradpatchError, NonFiniteError

    class ExportCLI(LightningCLI):
        """LightningCLI with an ``--export`` folder."""

        def add_arguments_to_parser(self, parser: Any) -> None:
            parser.add_argument("--export", type=str | None, default=None,
                                help=f"folder for the trained intervention (default: <default_root_dir>/{export_name})")
            parser.add_argument("--ckpt_path", type=str | None, default=None,
                                help="a Lightning checkpoint to resume training from (Trainer.fit's ckpt_path)")

    try:
        cli = ExportCLI(
            module_class, data_class, run=False, auto_configure_optimizers=False, args=list(args),
            trainer_defaults={**TRAINER_DEFAULTS, **(trainer_defaults or {})}, seed_everything_default=0,
            save_config_kwargs={"overwrite": True},
            parser_kwargs={"prog": "gradpatch fit", "description": description, "default_env": False}, **cli_options)
        trainer, module, data = cli.trainer, cli.model, cli.datamodule
        if prepare is not None:
            prepare(module, data, trainer)
    except (GradpatchError, FileNotFoundError) as error:
        return usage_error("fit", error)
    try:
        trainer.fit(module, datamodule=data, ckpt_path=cli.config.get("ckpt_path"))
    except NonFiniteError as error:
        print(f"gradpatch fit: {error}", file=sys.stderr)
        return 1
    if trainer.is_global_zero:
        root = Path(trainer.default_root_dir)
        export = cli.config.get("export")
        folder = module.export_intervention(Path(export) if export else root / export_name)
        print(f"gradpatch fit: {metrics(module, data, root)}; {export_name} saved to {folder}", file=sys.stderr)
    return 0
