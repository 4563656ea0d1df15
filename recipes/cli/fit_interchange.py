"""``gradpatch fit`` for interchange intervention training: an InterventionModule and a CounterfactualDataModule.

::

    gradpatch fit --config recipes/configs/das_country.yaml --data.train_file A --data.eval_file B \\
        --trainer.default_root_dir D

:func:`recipes.cli.fit.run_fit` sends a config with a ``data:`` section (or ``--data.*`` arguments) here. After
training, ``D/metrics.json`` holds the IIA on the eval file (train file without one) beside full-vector interchange
at the same nodes (:meth:`~recipes.intervention_module.InterventionModule.write_metrics`) and ``D/intervention``
the trained patches (or ``--export``). TensorBoard logs go under ``D/lightning_logs`` unless the config names a
logger.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["TRAINER_DEFAULTS", "is_interchange_config", "run_interchange_fit"]

#: Trainer settings used unless the config or the command line says otherwise (``logger: true`` is a
#: TensorBoardLogger under ``default_root_dir``).
TRAINER_DEFAULTS: dict[str, Any] = {"max_steps": 200, "log_every_n_steps": 5, "enable_model_summary": False,
                                    "logger": True, "enable_checkpointing": False}

_DESCRIPTION = ("Train trainable interchange patches (DAS, Boundless DAS, sigmoid masks) on counterfactual JSONL "
                "records (InterventionModule + CounterfactualDataModule); writes metrics.json and the intervention "
                "under --trainer.default_root_dir. See recipes/configs/das_country.yaml and docs/interventions.md.")


def is_interchange_config(args: Sequence[str]) -> bool:
    """Whether ``gradpatch fit`` arguments are for interchange training: a ``--data.*`` argument, or a ``--config``
    file with a top-level ``data`` section."""
    items = list(args)
    if any(item.startswith("--data") for item in items):
        return True
    for i, item in enumerate(items):
        path = items[i + 1] if item == "--config" and i + 1 < len(items) else (
            item.split("=", 1)[1] if item.startswith("--config=") else None)
        if path and Path(path).is_file():
            import yaml

            document = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
            if isinstance(document, dict) and "data" in document:
                return True
    return False


def run_interchange_fit(args: Sequence[str]) -> int:
    """Parse ``args`` with LightningCLI, train, write ``metrics.json`` and the intervention.

    Returns:
        0 on success; 1 when training stopped at a non-finite value (the error is printed, nothing is written).
    """
    from lightning.pytorch.cli import LightningCLI

    from gradpatch.errors import NonFiniteError

    from ..counterfactual import CounterfactualDataModule
    from ..intervention_module import InterventionModule

    class InterchangeCLI(LightningCLI):
        """LightningCLI for InterventionModule with an ``--export`` folder."""

        def add_arguments_to_parser(self, parser: Any) -> None:
            parser.add_argument("--export", type=str | None, default=None,
                                help="folder for the trained intervention (default: <default_root_dir>/intervention)")

    cli = InterchangeCLI(
        InterventionModule, CounterfactualDataModule, run=False, auto_configure_optimizers=False, args=list(args),
        trainer_defaults=TRAINER_DEFAULTS, seed_everything_default=0, save_config_kwargs={"overwrite": True},
        parser_kwargs={"prog": "gradpatch fit", "description": _DESCRIPTION, "default_env": False})
    trainer, module, data = cli.trainer, cli.model, cli.datamodule
    try:
        trainer.fit(module, datamodule=data)
    except NonFiniteError as error:
        print(f"gradpatch fit: {error}", file=sys.stderr)
        return 1
    if trainer.is_global_zero:
        root = Path(trainer.default_root_dir)
        export = cli.config.get("export")
        folder = module.export_intervention(Path(export) if export else root / "intervention")
        metrics = module.write_metrics(root, data.eval_records or data.train_records)
        print(f"gradpatch fit: IIA {metrics['iia']:.3f} (full interchange {metrics['full_interchange_iia']:.3f}) on "
              f"{metrics['examples']} records; {root / 'metrics.json'}; intervention saved to {folder}",
              file=sys.stderr)
    return 0
