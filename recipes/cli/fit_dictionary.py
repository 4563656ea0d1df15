"""``gradpatch fit`` for sparse dictionaries: a DictionaryFitModule with a DictionaryDataModule.

::

    gradpatch fit --config recipes/configs/sae_smollm2.yaml --trainer.default_root_dir runs/sae
    gradpatch fit --config recipes/configs/sae_smollm2.yaml --data.train_tokens 1024000 --model.lr 1e-3

:func:`recipes.cli.fit.run_fit` sends a config whose ``model:`` has a ``dictionary:`` section here. After training,
``D/dictionary`` holds the dictionary (or ``--export``; ``gradpatch dictionary eval --dictionary D/dictionary``
evaluates it again) and ``D/metrics.json`` its evaluation on the data module's held-out documents
(:func:`recipes.dictionary.write_dictionary_metrics`); TensorBoard logs under ``D/lightning_logs``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .fit_module import config_document, fit_and_export

__all__ = ["TRAINER_DEFAULTS", "is_dictionary_config", "run_dictionary_fit"]

#: Over :data:`recipes.cli.fit_module.TRAINER_DEFAULTS`: one pass over the data module's ``train_tokens``.
TRAINER_DEFAULTS: dict[str, Any] = {"max_epochs": 1, "max_steps": -1}

_DESCRIPTION = ("Train a sparse autoencoder or transcoder on a frozen model's streamed activations "
                "(DictionaryFitModule: local losses, shuffle buffer) over a text corpus (DictionaryDataModule); "
                "writes the dictionary and metrics.json under --trainer.default_root_dir. See "
                "recipes/configs/sae_smollm2.yaml and docs/dictionaries.md.")


def is_dictionary_config(args: Sequence[str]) -> bool:
    """Whether ``gradpatch fit`` arguments name a ``--config`` file whose ``model:`` has a ``dictionary:`` section."""
    document = config_document(args) or {}
    model = document.get("model")
    return isinstance(model, dict) and isinstance(model.get("dictionary"), dict)


def run_dictionary_fit(args: Sequence[str]) -> int:
    """Parse ``args`` with LightningCLI, train, write the dictionary and ``metrics.json``.

    Returns:
        0 on success; 1 when training stopped at a non-finite value (the error is printed, nothing is written).
    """
    from ..dictionary import DictionaryDataModule, DictionaryFitModule, write_dictionary_metrics

    def metrics(module: Any, data: Any, root: Path) -> str:
        scores = write_dictionary_metrics(module.graph, module.dictionary, data.eval_documents, root)
        return (f"held-out fvu {scores.fvu:.4f}, l0 {scores.l0:.1f}, CE loss recovered {scores.ce_loss_recovered:.4f} "
                f"on {scores.n_tokens} tokens -> {root / 'metrics.json'}")

    return fit_and_export(DictionaryFitModule, DictionaryDataModule, args, _DESCRIPTION, metrics,
                          export_name="dictionary", trainer_defaults=TRAINER_DEFAULTS)
