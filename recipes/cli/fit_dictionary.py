"""``gradpatch fit`` for sparse dictionaries: a DictionaryFitModule with a DictionaryDataModule.

::

    gradpatch fit --config recipes/configs/sae_smollm2.yaml --trainer.default_root_dir runs/sae
    gradpatch fit --config recipes/configs/sae_smollm2.yaml --data.train_tokens 1024000 --model.lr 1e-3
    gradpatch fit --config recipes/configs/transcoders_smollm2.yaml --trainer.default_root_dir runs/transcoders
    gradpatch fit --config recipes/configs/clt_smollm2.yaml --trainer.default_root_dir runs/clt

:func:`recipes.cli.fit.run_fit` sends a config whose ``model:`` has a ``dictionary:`` section here (a
:class:`~recipes.dictionary.DictionaryFitModule`; or ``model.class_path`` with ``init_args.dictionary``, e.g.
:class:`~recipes.dictionary.EndToEndDictionaryFitModule`, ``recipes/configs/sae_smollm2_e2e.yaml``); one whose
``model:`` has a ``clt:`` section trains a cross-layer transcoder (:class:`~recipes.dictionary.CLTFitModule`,
``recipes/configs/clt_smollm2.yaml``). After training, ``D/dictionary`` holds the dictionary (several:
``D/dictionary/<node>/`` each, one :func:`~gradpatch.dictionaries.save_dictionary` folder per written node; a CLT:
its :func:`~gradpatch.dictionaries.save_clt` files; or ``--export``; ``gradpatch dictionary eval --dictionary
D/dictionary`` evaluates one dictionary again) and ``D/metrics.json`` its evaluation on the data module's held-out
documents: ``{"dictionaries": {node: metrics}}`` (:func:`recipes.dictionary.write_dictionary_metrics`), and for
several layers or a CLT each layer spliced alone plus ``"all_spliced"``, every layer spliced at once
(:func:`recipes.dictionary.write_layer_metrics`); TensorBoard logs under ``D/lightning_logs``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .fit_module import config_document, fit_and_export

__all__ = ["TRAINER_DEFAULTS", "is_dictionary_config", "run_dictionary_fit"]

#: Over :data:`recipes.cli.fit_module.TRAINER_DEFAULTS`: one pass over the data module's ``train_tokens``.
TRAINER_DEFAULTS: dict[str, Any] = {"max_epochs": 1, "max_steps": -1}

_DESCRIPTION = ("Train sparse autoencoders or transcoders on a frozen model's streamed activations "
                "(DictionaryFitModule: local losses, shuffle buffer, one dictionary per node or, with layers: all, "
                "per layer; with a clt: section, a cross-layer transcoder, CLTFitModule; or, with model.class_path "
                "recipes.dictionary.EndToEndDictionaryFitModule, end to end: KL and the e2e+ds downstream terms) "
                "over a text corpus (DictionaryDataModule); writes the dictionaries and metrics.json under "
                "--trainer.default_root_dir. See recipes/configs/sae_smollm2.yaml, sae_smollm2_e2e.yaml, "
                "transcoders_smollm2.yaml, clt_smollm2.yaml and docs/dictionaries.md.")


def is_dictionary_config(args: Sequence[str]) -> bool:
    """Whether ``gradpatch fit`` arguments name a ``--config`` file whose ``model:`` (or its ``init_args:``) has a
    ``dictionary:`` section (one spec or a list) or a ``clt:`` section."""
    return _model_section(args) is not None


def _model_section(args: Sequence[str]) -> dict[str, Any] | None:
    """The ``--config`` file's ``model:`` mapping when it has a ``dictionary:`` or ``clt:`` (directly or under
    ``init_args:``)."""
    document = config_document(args) or {}
    model = document.get("model")
    if not isinstance(model, dict):
        return None
    fields = model.get("init_args") if isinstance(model.get("init_args"), dict) else model
    return model if isinstance(fields.get("dictionary"), (dict, list)) or isinstance(fields.get("clt"), dict) else None


def run_dictionary_fit(args: Sequence[str]) -> int:
    """Parse ``args`` with LightningCLI, train, write the dictionary and ``metrics.json``.

    Returns:
        0 on success; 2 when the config is refused before training (a NodePath the model lacks, a corpus file that
        is missing or too short for one chunk: nothing is written); 1 when training stopped at a non-finite value (the
        error is printed, nothing is written).
    """
    from ..dictionary import (CLTFitModule, DictionaryDataModule, DictionaryFitModule, StreamingModule,
                              write_dictionary_metrics, write_layer_metrics)

    def metrics(module: Any, data: Any, root: Path) -> str:
        layers = module.layer_stack()
        if layers is None:
            scores = write_dictionary_metrics(module.graph, list(module.dictionaries), data.eval_documents, root)
            together = ""
        else:  # several layers: each spliced alone, and all spliced at once
            stack = write_layer_metrics(module.graph, layers, data.eval_documents, root)
            scores, every = stack.layers, stack.all_spliced
            together = (f"; all {every.n_layers} spliced at once: CE loss recovered {every.ce_loss_recovered:.4f} "
                        f"(CE {every.ce_loss_original:.4f} -> {every.ce_loss_spliced:.4f})")
        return ", ".join(f"{node}: held-out fvu {s.fvu:.4f}, l0 {s.l0:.1f}, CE loss recovered {s.ce_loss_recovered:.4f}"
                         for node, s in scores.items()) + together + f" -> {root / 'metrics.json'}"

    section = _model_section(args) or {}
    if "class_path" in section:  # e.g. recipes.dictionary.EndToEndDictionaryFitModule
        return fit_and_export(StreamingModule, DictionaryDataModule, args, _DESCRIPTION, metrics,
                              export_name="dictionary", trainer_defaults=TRAINER_DEFAULTS, prepare=_read_corpus,
                              subclass_mode_model=True)
    fit_module = CLTFitModule if "clt" in section else DictionaryFitModule
    return fit_and_export(fit_module, DictionaryDataModule, args, _DESCRIPTION, metrics,
                          export_name="dictionary", trainer_defaults=TRAINER_DEFAULTS, prepare=_read_corpus)


def _read_corpus(module: Any, data: Any, trainer: Any) -> None:
    """Run the data module's ``setup`` (it reads and tokenizes the corpus once; Lightning's own call then returns at
    once) before training, so that a missing or too short corpus is refused before Lightning creates its logs.

    Raises:
        FileNotFoundError: the corpus file does not exist.
        RecipeConfigError: the corpus is too short for one training chunk, or the run could not take one optimiser
            step (:meth:`recipes.dictionary.fit.DictionaryDataModule.check_steps`).
    """
    from ..errors import RecipeConfigError

    data.trainer = trainer
    trainer.strategy.connect(module)  # the data module tokenizes with trainer.lightning_module's tokenizer
    try:
        data.setup("fit")
    except RecipeConfigError as error:
        if data.chunks is not None:  # the corpus was read: the run itself is refused (its message names the fix)
            raise
        raise RecipeConfigError(f"--data.corpus {data.corpus or '(the Wikipedia summaries)'}: {error}; give a longer "
                                f"corpus or a smaller --data.chunk_length") from error
