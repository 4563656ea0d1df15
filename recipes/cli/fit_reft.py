"""``gradpatch fit`` for ReFT and BiPO: a ReFTModule with a ContinuationDataModule or a PreferenceDataModule.

::

    gradpatch fit --config recipes/configs/loreft_capitals.yaml --trainer.default_root_dir runs/loreft
    gradpatch fit --config recipes/configs/bipo_sentiment.yaml --trainer.default_root_dir runs/bipo

:func:`recipes.cli.fit.run_fit` sends a config whose ``data:`` names one of those data modules (``class_path``)
here. After training, ``D/metrics.json`` holds :meth:`~recipes.reft.ReFTModule.evaluate` on the eval file
(train file without one) beside the frozen model's scores, and ``D/intervention`` the trained patches (or
``--export``); ``gradpatch generate --intervention D/intervention --prompt ...`` tries them.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .fit_module import config_document, fit_and_export

__all__ = ["is_reft_config", "run_reft_fit"]

_DATA_MODULES = ("ContinuationDataModule", "PreferenceDataModule")
_DESCRIPTION = ("Train LoReFT/DiReFT patches on {prompt, response} JSONL (continuation NLL) or steering vectors on "
                "{prompt, chosen, rejected} JSONL (BiPO) with a ReFTModule; writes metrics.json and the intervention "
                "under --trainer.default_root_dir. See recipes/configs/loreft_*.yaml, bipo_*.yaml.")


def is_reft_config(args: Sequence[str]) -> bool:
    """Whether ``gradpatch fit`` arguments name a ``--config`` file whose ``data.class_path`` is a continuation or
    preference data module."""
    document = config_document(args) or {}
    data = document.get("data")
    return isinstance(data, dict) and str(data.get("class_path", "")).endswith(_DATA_MODULES)


def run_reft_fit(args: Sequence[str]) -> int:
    """Parse ``args`` with LightningCLI, train, write ``metrics.json`` and the intervention.

    Returns:
        0 on success; 1 when training stopped at a non-finite value (the error is printed, nothing is written).
    """
    from lightning.pytorch import LightningDataModule

    from ..reft import ReFTModule

    def metrics(module: Any, data: Any, root: Path) -> str:
        return str(module.write_metrics(root, data.eval_records or data.train_records))

    return fit_and_export(ReFTModule, LightningDataModule, args, _DESCRIPTION, metrics, subclass_mode_data=True)
