"""``gradpatch fit`` for interchange intervention training: an InterventionModule and a CounterfactualDataModule.

::

    gradpatch fit --config recipes/configs/das_country.yaml --data.train_file A --data.eval_file B \\
        --trainer.default_root_dir D

:func:`recipes.cli.fit.run_fit` sends a config with a ``data:`` section (or ``--data.*`` arguments) here. After
training, ``D/metrics.json`` holds the IIA on the eval file (train file without one) beside full-vector interchange
at the same nodes (:meth:`~recipes.interchange.InterventionModule.write_metrics`) and ``D/intervention``
the trained patches (or ``--export``). TensorBoard logs go under ``D/lightning_logs`` unless the config names a
logger.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .fit_module import config_document, fit_and_export

__all__ = ["is_interchange_config", "run_interchange_fit"]

_DESCRIPTION = ("Train trainable interchange patches (DAS, Boundless DAS, sigmoid masks) on counterfactual JSONL "
                "records (InterventionModule + CounterfactualDataModule); writes metrics.json and the intervention "
                "under --trainer.default_root_dir. See recipes/configs/das_country.yaml and docs/interventions.md.")


def is_interchange_config(args: Sequence[str]) -> bool:
    """Whether ``gradpatch fit`` arguments are for interchange training: a ``--data.*`` argument, or a ``--config``
    file with a top-level ``data`` section."""
    if any(item.startswith("--data") for item in args):
        return True
    document = config_document(args)
    return document is not None and "data" in document


def run_interchange_fit(args: Sequence[str]) -> int:
    """Parse ``args`` with LightningCLI, train, write ``metrics.json`` and the intervention.

    Returns:
        0 on success; 1 when training stopped at a non-finite value (the error is printed, nothing is written).
    """
    from ..interchange import CounterfactualDataModule, InterventionModule

    def metrics(module: Any, data: Any, root: Path) -> str:
        written = module.write_metrics(root, data.eval_records or data.train_records)
        return (f"IIA {written['iia']:.3f} (full interchange {written['full_interchange_iia']:.3f}) on "
                f"{written['examples']} records; {root / 'metrics.json'}")

    return fit_and_export(InterventionModule, CounterfactualDataModule, args, _DESCRIPTION, metrics)
