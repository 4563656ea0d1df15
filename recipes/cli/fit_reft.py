"""``gradpatch fit`` for ReFT and BiPO: a ReFTModule with a ContinuationDataModule or a PreferenceDataModule.

::

    gradpatch fit --config recipes/configs/loreft_capitals.yaml --trainer.default_root_dir runs/loreft
    gradpatch fit --config recipes/configs/bipo_sentiment.yaml --trainer.default_root_dir runs/bipo

:func:`recipes.cli.fit.run_fit` sends a config whose ``data:`` names one of those data modules (``class_path``)
here. After training, ``D/metrics.json`` holds :meth:`~recipes.reft_module.ReFTModule.evaluate` on the eval file
(train file without one) beside the frozen model's scores, and ``D/intervention`` the trained patches (or
``--export``); ``gradpatch generate --intervention D/intervention --prompt ...`` tries them.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["is_reft_config", "run_reft_fit"]

_DATA_MODULES = ("ContinuationDataModule", "PreferenceDataModule")
_DESCRIPTION = ("Train LoReFT/DiReFT patches on {prompt, response} JSONL (continuation NLL) or steering vectors on "
                "{prompt, chosen, rejected} JSONL (BiPO) with a ReFTModule; writes metrics.json and the intervention "
                "under --trainer.default_root_dir. See recipes/configs/loreft_*.yaml, bipo_*.yaml.")


def is_reft_config(args: Sequence[str]) -> bool:
    """Whether ``gradpatch fit`` arguments name a ``--config`` file whose ``data.class_path`` is a continuation or
    preference data module."""
    items = list(args)
    for i, item in enumerate(items):
        path = items[i + 1] if item == "--config" and i + 1 < len(items) else (
            item.split("=", 1)[1] if item.startswith("--config=") else None)
        if path and Path(path).is_file():
            import yaml

            document = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
            data = document.get("data") if isinstance(document, dict) else None
            if isinstance(data, dict) and str(data.get("class_path", "")).endswith(_DATA_MODULES):
                return True
    return False


def run_reft_fit(args: Sequence[str]) -> int:
    """Parse ``args`` with LightningCLI, train, write ``metrics.json`` and the intervention.

    Returns:
        0 on success; 1 when training stopped at a non-finite value (the error is printed, nothing is written).
    """
    from lightning.pytorch import LightningDataModule
    from lightning.pytorch.cli import LightningCLI

    from gradpatch.errors import NonFiniteError

    from ..reft_module import ReFTModule
    from .fit_interchange import TRAINER_DEFAULTS

    class ReFTCLI(LightningCLI):
        """LightningCLI for ReFTModule with an ``--export`` folder."""

        def add_arguments_to_parser(self, parser: Any) -> None:
            parser.add_argument("--export", type=str | None, default=None,
                                help="folder for the trained intervention (default: <default_root_dir>/intervention)")

    cli = ReFTCLI(
        ReFTModule, LightningDataModule, subclass_mode_data=True, run=False, auto_configure_optimizers=False,
        args=list(args), trainer_defaults=TRAINER_DEFAULTS, seed_everything_default=0,
        save_config_kwargs={"overwrite": True},
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
        metrics = module.write_metrics(root, module.evaluate(data.eval_records or data.train_records))
        print(f"gradpatch fit: {metrics}; intervention saved to {folder}", file=sys.stderr)
    return 0
