"""What ``gradpatch fit`` builds from a dictionary config: a :class:`DictionaryModule` that loads its model and
builds its dictionary from YAML fields, and the data module of corpus chunks it trains on.

::

    model:
      model_path: null                       # the embedded SmolLM2-135M-Instruct
      dictionary: {node: model.layers_12.output, activation: topk, k: 32, expansion_factor: 4}
    data:
      corpus: null                           # the offline Wikipedia summaries; or a .txt / .jsonl file
      train_tokens: 204800

:class:`DictionaryDataModule` holds out the first documents (``eval_tokens`` of them) for the evaluation written to
``metrics.json`` after training, and packs the documents after them into chunks of ``chunk_length`` tokens
(:func:`recipes.dictionary.corpus.packed_chunks`), one pass, in order (the buffer shuffles the rows). Its
checkpointed state is the batches done, so ``gradpatch fit --ckpt_path CKPT`` goes on from the next one.

``model:`` may list several dictionaries (``dictionary: [{node: ...}, {node: ...}]``: one run, several nodes), give
one spec ``layers: all`` (or a list of layer indices) to train one dictionary per layer from one forward pass
(``node: mlp_input, output_node: mlp``: the model layout's MLP input and output, :func:`expand_spec`;
``recipes/configs/transcoders_smollm2.yaml``), or name ``class_path: recipes.dictionary.EndToEndDictionaryFitModule``
with the fields under ``init_args:`` (end-to-end training, ``recipes/configs/sae_smollm2_e2e.yaml``).
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch
from lightning.fabric.utilities.warnings import PossibleUserWarning
from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader, Sampler

from editors import editable_graph
from gradpatch.capture import node_activations
from gradpatch.dictionaries import SkipTranscoder, SparseAutoencoder, SparseDictionary, Transcoder
from gradpatch.model_io import model_device

from ..errors import RecipeConfigError
from ..training.frozen import DtypeName, EMBEDDED_MODEL_LABEL, OptimizerName
from .corpus import packed_chunks, read_documents, tokenize_documents
from .end_to_end import EndToEndDictionaryModule, downstream_residual_nodes
from .module import AUXK_COEFFICIENT, AuxKNormalization, BDecInit, DictionaryModule, SkipInit
from .streaming import StreamingModule

__all__ = ["DictionaryDataModule", "DictionaryFitModule", "DictionarySpec", "EndToEndDictionaryFitModule",
           "UNACTIONABLE_WARNINGS", "build_dictionaries", "build_dictionary", "expand_spec", "layer_nodes",
           "load_graph"]

#: Lightning's warnings (``PossibleUserWarning``s, by message) that :class:`DictionaryDataModule` hides during its
#: stages, since a user of it can do nothing about them:
#:
#: - resuming mid-epoch from a loader without ``state_dict`` "can cause unreliable results": the data module
#:   checkpoints the batches done and starts after them, so the resume is exact (tests/recipes/test_dictionaries_cli.py);
#: - the loader "does not have many workers": its batches are slices of a tensor already in memory (workers would
#:   only copy them between processes), and it has no ``num_workers`` setting to raise.
UNACTIONABLE_WARNINGS = (
    r"You're resuming from a checkpoint that ended before the epoch ended and your dataloader is not resumable",
    r"The 'train_dataloader' does not have many workers",
)


@dataclass
class DictionarySpec:
    """The dictionary to train.

    Attributes:
        node: the NodePath read (and an SAE's written), e.g. ``"model.layers_12.output"``.
        kind: ``"sae"``, ``"transcoder"`` or ``"skip_transcoder"``.
        output_node: a transcoder's NodePath predicted, e.g. ``"model.layers_3.mlp.output"``.
        activation: ``"topk"``, ``"batchtopk"``, ``"jumprelu"`` or ``"relu"``.
        k: active latents per token (TopK, BatchTopK).
        expansion_factor: latents per input dimension, unless ``d_sae`` is given.
        d_sae: the number of latents.
        exclude_first_positions: the first positions of every sequence left out of training and evaluation
            (:class:`gradpatch.dictionaries.DictionaryConfig`; 2 for SmolLM2's attention sinks).
        layers: one dictionary per layer: ``"all"`` (every block of the model) or a list of block indices; then
            ``node`` and ``output_node`` are NodePath templates with ``{layer}`` (``model.layers_{layer}.mlp.x``) or
            parts of the model's layout (``mlp_input``, ``mlp``, ``resid``:
            :meth:`gradpatch.layouts.ModelLayout.template`).
            ``None`` (default): the one dictionary at ``node``.
    """

    node: str
    kind: Literal["sae", "transcoder", "skip_transcoder"] = "sae"
    output_node: str | None = None
    activation: Literal["topk", "batchtopk", "jumprelu", "relu"] = "topk"
    k: int | None = 32
    expansion_factor: int = 4
    d_sae: int | None = None
    exclude_first_positions: int = 0
    layers: Literal["all"] | list[int] | None = None


def layer_nodes(pg: Any, name: str, layers: Literal["all"] | list[int]) -> list[str]:
    """The NodePaths of ``name`` at ``layers``: ``name`` a template with ``{layer}`` or a part of ``pg``'s layout
    (:func:`gradpatch.layouts.detect_layout`, e.g. ``"mlp_input"`` -> ``model.layers_{layer}.mlp.x`` on Llama);
    ``"all"``: every block (:func:`gradpatch.layouts.count_layers`).

    Raises:
        RecipeConfigError: a layer outside the model's blocks, or a name that is neither a template nor a layout part.
        LayoutError: no known layout holds on ``pg``.
    """
    from gradpatch.errors import LayoutError
    from gradpatch.layouts import count_layers, detect_layout

    layout = detect_layout(pg)
    count = count_layers(pg, layout)
    indices = list(range(count)) if layers == "all" else [int(i) for i in layers]
    if not indices or any(not 0 <= i < count for i in indices):
        raise RecipeConfigError(f"layers {layers!r}: give 'all' or block indices in 0..{count - 1}")
    if "{layer}" not in name:
        try:
            name = layout.template(name)
        except LayoutError as error:
            raise RecipeConfigError(f"dictionary node {name!r} with layers: give a NodePath template with "
                                    f"{{layer}} or a layout part such as 'mlp_input' or 'mlp' ({error})") from error
    return [name.format(layer=i) for i in indices]


def expand_spec(pg: Any, spec: DictionarySpec) -> list[DictionarySpec]:
    """``spec`` itself, or with ``layers`` one spec per layer at that layer's nodes (:func:`layer_nodes`), in layer
    order.

    Raises:
        RecipeConfigError, LayoutError: as :func:`layer_nodes`.
    """
    if spec.layers is None:
        return [spec]
    inputs = layer_nodes(pg, spec.node, spec.layers)
    outputs = layer_nodes(pg, spec.output_node, spec.layers) if spec.output_node else [None] * len(inputs)
    return [dataclasses.replace(spec, node=read, output_node=write, layers=None)
            for read, write in zip(inputs, outputs)]


def build_dictionary(pg: Any, spec: DictionarySpec, seed: int = 0) -> SparseDictionary:
    """A freshly initialised dictionary of ``spec`` whose widths are those of its nodes in ``pg`` (read in one short
    forward pass).

    Raises:
        RecipeConfigError: a transcoder without ``output_node``.
        NodePathError: a NodePath the graph lacks.
        DictionaryConfigError: an invalid combination (``k`` above the width, ...).
    """
    if spec.kind != "sae" and spec.output_node is None:
        raise RecipeConfigError(f"a {spec.kind} needs dictionary.output_node (the NodePath it predicts)")
    for path in (spec.node, spec.output_node or spec.node):
        pg.node(path)
    nodes = [spec.node] + ([spec.output_node] if spec.kind != "sae" else [])
    example = torch.ones(2, 2, dtype=torch.long, device=model_device(pg))  # the batch size the graph was built on
    widths = [int(a.shape[-1]) for a in node_activations(pg, nodes, example)]
    d_sae = spec.d_sae or spec.expansion_factor * widths[0]
    k = spec.k if spec.activation in ("topk", "batchtopk") else None
    generator = torch.Generator().manual_seed(seed)
    if spec.kind == "sae":
        return SparseAutoencoder(widths[0], d_sae, spec.activation, k, node=spec.node,
                                 exclude_first_positions=spec.exclude_first_positions, generator=generator)
    kind = SkipTranscoder if spec.kind == "skip_transcoder" else Transcoder
    return kind(widths[0], d_sae, widths[-1], spec.activation, k, input_node=spec.node, output_node=spec.output_node,
                exclude_first_positions=spec.exclude_first_positions, generator=generator)


def load_graph(model_path: str | None, dtype: DtypeName) -> tuple[Any, Any]:
    """``(pg, tokenizer)``: the model at ``model_path`` (``None``: the embedded SmolLM2-135M-Instruct) in ``dtype``,
    its graph extracted by :func:`editors.editable_graph`."""
    from gradpatch.files.loaders import load_model

    model, tokenizer = load_model(model_path, dtype=getattr(torch, dtype))
    return editable_graph(model, tokenizer), tokenizer


def build_dictionaries(pg: Any, specs: DictionarySpec | list[DictionarySpec], seed: int) -> list[SparseDictionary]:
    """:func:`build_dictionary` of each spec (one spec or a list: several nodes in one run; a spec with ``layers``:
    one per layer, :func:`expand_spec`); the ``i``-th dictionary is seeded ``seed + i``."""
    specs = [specs] if isinstance(specs, DictionarySpec) else list(specs)
    expanded = [one for spec in specs for one in expand_spec(pg, spec)]
    return [build_dictionary(pg, spec, seed + i) for i, spec in enumerate(expanded)]


class DictionaryFitModule(DictionaryModule):
    """A :class:`DictionaryModule` built from config fields: it loads the model and builds the dictionaries.

    Args:
        dictionary: what to train (:class:`DictionarySpec`), or a list of them (several nodes in one run).
        model_path: a ``save_pretrained`` directory or ``.gguf`` file; ``None`` for the embedded SmolLM2-135M-Instruct.
        dtype: the model's dtype (the dictionary trains in float32).
        buffer_rows, lr, optimizer, sparsity_coefficient, auxk_coefficient, dead_after_tokens, unit_norm_decoder,
            seed, density_every_n_steps, ce_every_n_steps, b_dec_init, auxk_normalization, lr_warmup_steps,
            lr_decay_fraction, sparsity_warmup_steps, skip_init, skip_ridge: as :class:`DictionaryModule` (``seed``
            also seeds the initial weights).

    Raises:
        RecipeConfigError, NodePathError, DictionaryConfigError: as :func:`build_dictionary` and
            :class:`DictionaryModule`.
    """

    def __init__(self, dictionary: DictionarySpec | list[DictionarySpec], model_path: str | None = None,
                 dtype: DtypeName = "float32", buffer_rows: int = 8192, lr: float = 2e-4,
                 optimizer: OptimizerName = "adam", sparsity_coefficient: float = 1e-3,
                 auxk_coefficient: float = AUXK_COEFFICIENT, dead_after_tokens: int = 10_000_000,
                 unit_norm_decoder: bool = True, seed: int = 0, density_every_n_steps: int = 50,
                 ce_every_n_steps: int = 50, b_dec_init: BDecInit = "mean",
                 auxk_normalization: AuxKNormalization = "residual", lr_warmup_steps: int = 0,
                 lr_decay_fraction: float = 0.0, sparsity_warmup_steps: int = 0, skip_init: SkipInit = "zero",
                 skip_ridge: float = 1e-4) -> None:
        pg, tokenizer = load_graph(model_path, dtype)
        super().__init__(pg, build_dictionaries(pg, dictionary, seed), buffer_rows=buffer_rows, lr=lr,
                         optimizer=optimizer, sparsity_coefficient=sparsity_coefficient,
                         auxk_coefficient=auxk_coefficient, dead_after_tokens=dead_after_tokens,
                         unit_norm_decoder=unit_norm_decoder, seed=seed, density_every_n_steps=density_every_n_steps,
                         ce_every_n_steps=ce_every_n_steps, b_dec_init=b_dec_init,
                         auxk_normalization=auxk_normalization, lr_warmup_steps=lr_warmup_steps,
                         lr_decay_fraction=lr_decay_fraction, sparsity_warmup_steps=sparsity_warmup_steps,
                         skip_init=skip_init, skip_ridge=skip_ridge)
        self.tokenizer = tokenizer
        self.model_label = model_path or EMBEDDED_MODEL_LABEL


class EndToEndDictionaryFitModule(EndToEndDictionaryModule):
    """An :class:`~recipes.dictionary.EndToEndDictionaryModule` built from config fields (``gradpatch fit`` with
    ``model.class_path: recipes.dictionary.EndToEndDictionaryFitModule``, ``recipes/configs/sae_smollm2_e2e.yaml``).

    Args:
        dictionary, model_path, dtype, seed: as :class:`DictionaryFitModule`.
        lr, optimizer, sparsity_coefficient, dead_after_tokens, unit_norm_decoder, density_every_n_steps,
            downstream_coefficient, b_dec_init: as :class:`~recipes.dictionary.EndToEndDictionaryModule`.
        downstream_nodes: the NodePaths of the e2e+ds terms, or ``"residual"`` for Braun et al.'s choice after the last
            listed dictionary's written node (:func:`~recipes.dictionary.downstream_residual_nodes`); ``None``:
            none (plain e2e).

    Raises:
        RecipeConfigError, NodePathError, DictionaryConfigError: as :class:`DictionaryFitModule` and
            :class:`~recipes.dictionary.EndToEndDictionaryModule`.
    """

    def __init__(self, dictionary: DictionarySpec | list[DictionarySpec], model_path: str | None = None,
                 dtype: DtypeName = "float32", lr: float = 2e-4, optimizer: OptimizerName = "adam",
                 sparsity_coefficient: float = 1e-3, dead_after_tokens: int = 10_000_000,
                 unit_norm_decoder: bool = True, seed: int = 0, density_every_n_steps: int = 50,
                 downstream_nodes: list[str] | Literal["residual"] | None = None,
                 downstream_coefficient: float = 0.0, b_dec_init: BDecInit = "mean") -> None:
        pg, tokenizer = load_graph(model_path, dtype)
        dictionaries = build_dictionaries(pg, dictionary, seed)
        if downstream_nodes == "residual":
            downstream_nodes = downstream_residual_nodes(pg, str(dictionaries[-1].config.output_node
                                                                 or dictionaries[-1].config.input_node))
        super().__init__(pg, dictionaries, lr=lr, optimizer=optimizer, sparsity_coefficient=sparsity_coefficient,
                         dead_after_tokens=dead_after_tokens, unit_norm_decoder=unit_norm_decoder,
                         downstream_nodes=downstream_nodes or (), downstream_coefficient=downstream_coefficient,
                         density_every_n_steps=density_every_n_steps, b_dec_init=b_dec_init)
        self.tokenizer = tokenizer
        self.model_label = model_path or EMBEDDED_MODEL_LABEL


class ResumedRows(Sampler[int]):
    """Row indices ``0 .. rows − 1`` in order, starting at ``start``; its length is the whole epoch's, as Lightning
    counts the batches done before a checkpoint in it. A plain sampler (not a batch sampler), so that Lightning can
    still shard it over DDP ranks (``DistributedSamplerWrapper``)."""

    def __init__(self, rows: int, start: int = 0) -> None:
        self.rows, self.start = rows, start

    def __len__(self) -> int:
        return self.rows

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.start, self.rows))


class DictionaryDataModule(LightningDataModule):
    """Chunks of corpus tokens to train on, and held-out documents to evaluate on (module docstring); the tokenizer
    is the module's (``trainer.lightning_module.tokenizer``).

    Args:
        corpus: a ``.txt`` (one document per line) or ``.jsonl`` (``text`` field) file; ``None`` for the offline
            English Wikipedia summaries.
        train_tokens: training tokens (whole chunks; fewer when the corpus is shorter).
        chunk_length: tokens per training row of a batch.
        batch_size: chunks per step.
        eval_tokens: held-out tokens scored after training.
        max_length: tokens per document at most.

    From :meth:`setup` to :meth:`teardown` (or :meth:`on_exception`) Lightning's warnings that a user of this data
    module cannot act on are hidden (:data:`UNACTIONABLE_WARNINGS`: "dataloader is not resumable" when its resume is
    exact, "does not have many workers" for batches already in memory), and the filters restored after.

    Raises:
        RecipeConfigError: a count below 1 (``eval_tokens``, ``max_length`` below 2), or at setup: a corpus too
            short for one chunk, or a run that could not take one optimizer step (a ``chunk_length`` within the
            dictionaries' ``exclude_first_positions``, or fewer rows over the run than a
            :class:`DictionaryModule`'s ``buffer_rows``, so that its shuffle buffer never fills; the message names
            the ``train_tokens`` needed).
        FileNotFoundError: at setup, a corpus file that does not exist.
    """

    def __init__(self, corpus: str | None = None, train_tokens: int = 204_800, chunk_length: int = 128,
                 batch_size: int = 8, eval_tokens: int = 4096, max_length: int = 256) -> None:
        super().__init__()
        if min(train_tokens, chunk_length, batch_size) < 1 or min(eval_tokens, max_length) < 2:
            raise RecipeConfigError(f"train_tokens ({train_tokens}), chunk_length ({chunk_length}) and batch_size "
                                    f"({batch_size}) must be >= 1, eval_tokens ({eval_tokens}) and max_length "
                                    f"({max_length}) >= 2")
        self.corpus, self.train_tokens, self.chunk_length = corpus, train_tokens, chunk_length
        self.batch_size, self.eval_tokens, self.max_length = batch_size, eval_tokens, max_length
        self.chunks: torch.Tensor | None = None
        self.eval_documents: list[list[int]] = []
        #: From a checkpoint: ``{"epoch", "batches"}`` done (:meth:`load_state_dict`).
        self.resume: dict[str, int] = {}
        #: The warning filters of the current stage (:meth:`setup` to :meth:`teardown`), ``None`` outside one.
        self.warning_filters: warnings.catch_warnings | None = None

    def setup(self, stage: str) -> None:
        """Read and tokenize the corpus (once); for ``fit``, refuse a run without an optimizer step
        (:meth:`check_steps`); then hide :data:`UNACTIONABLE_WARNINGS` until :meth:`teardown`."""
        if self.chunks is None:
            tokenizer = self.trainer.lightning_module.tokenizer
            documents = read_documents(self.corpus)
            self.eval_documents, read = tokenize_documents(tokenizer, documents, self.eval_tokens, self.max_length)
            self.chunks = packed_chunks(tokenizer, documents[read:], max(self.train_tokens // self.chunk_length, 1),
                                        self.chunk_length, self.max_length)
        if stage == "fit":
            self.check_steps()
        if self.warning_filters is None:
            self.warning_filters = warnings.catch_warnings()
            self.warning_filters.__enter__()  # left in teardown or on_exception: the filters last this stage only
            for message in UNACTIONABLE_WARNINGS:
                warnings.filterwarnings("ignore", message=message, category=PossibleUserWarning)

    def teardown(self, stage: str) -> None:
        """Restore the warning filters :meth:`setup` changed."""
        if self.warning_filters is not None:
            self.warning_filters.__exit__(None, None, None)
            self.warning_filters = None

    def on_exception(self, exception: BaseException) -> None:
        """Restore the warning filters when the stage fails (Lightning calls no ``teardown`` then)."""
        self.teardown("fit")

    def check_steps(self) -> None:
        """Refuse a run in which a :class:`DictionaryModule` could take no optimizer step: its shuffle buffer fills
        only once it holds ``buffer_rows`` rows, and each chunk gives ``chunk_length − exclude_first_positions``
        rows, on each DDP rank (Lightning's sampler gives each the same number of chunks), over
        ``trainer.max_epochs`` epochs (no check when unbounded: ``max_steps`` then ends a run that fills first)
        and within ``limit_train_batches``. An end-to-end module's one-row buffer fills on any batch.

        Raises:
            RecipeConfigError: no position left to train on, or fewer rows than ``buffer_rows`` (the message names
                the ``train_tokens`` that fill the buffer).
        """
        module, trainer = self.trainer.lightning_module, self.trainer
        if not isinstance(module, StreamingModule) or self.chunks is None:
            return
        excluded = module.exclude_first_positions
        rows_per_chunk = self.chunk_length - excluded
        if rows_per_chunk < 1:
            raise RecipeConfigError(f"data.chunk_length={self.chunk_length} leaves no position to train on: the "
                                    f"dictionaries leave out their first exclude_first_positions={excluded}; raise "
                                    f"--data.chunk_length above {excluded}")
        epochs = trainer.max_epochs
        if epochs is None or epochs < 0:
            return
        chunks = math.ceil(len(self.chunks) / trainer.world_size)
        limit = trainer.limit_train_batches
        batches = math.ceil(chunks / self.batch_size)
        batches = min(batches, limit) if isinstance(limit, int) else int(batches * limit)
        rows = epochs * min(chunks, batches * self.batch_size) * rows_per_chunk
        capacity = module.buffer.capacity
        if rows < capacity:
            needed = math.ceil(capacity / (epochs * rows_per_chunk)) * trainer.world_size * self.chunk_length
            raise RecipeConfigError(
                f"the run would push {rows} activation rows into a shuffle buffer of buffer_rows={capacity} "
                f"({len(self.chunks)} chunks of {self.chunk_length} tokens, {rows_per_chunk} rows each after "
                f"exclude_first_positions={excluded}, over {trainer.world_size} rank(s), {epochs} epoch(s), "
                f"limit_train_batches={limit}): the buffer would never fill and no optimizer step would be taken; "
                f"raise --data.train_tokens to at least {needed} (or lower --model.buffer_rows to at most {rows}, "
                f"or raise --trainer.max_epochs)")

    def train_dataloader(self) -> DataLoader:
        """The chunks ``[batch_size, chunk_length]`` in corpus order; resumed from a checkpoint taken in this epoch,
        those after the batches it had done."""
        done = self.resume["batches"] if self.resume.get("epoch") == self.trainer.current_epoch else 0
        return DataLoader(self.chunks, batch_size=self.batch_size,
                          sampler=ResumedRows(len(self.chunks), done * self.batch_size))

    def state_dict(self) -> dict[str, int]:
        """What a checkpoint keeps: the epoch and the batches of it done (so a resumed run goes on from the next)."""
        progress = self.trainer.fit_loop.epoch_loop.batch_progress.current
        return {"epoch": self.trainer.current_epoch, "batches": progress.processed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Take :meth:`state_dict`'s position back from a checkpoint."""
        self.resume = dict(state)
