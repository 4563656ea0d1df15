"""DeltaModule: train AddPatch deltas at chosen NodePaths of a frozen model with Lightning.

Example (what ``recipes/configs/steer_eiffel.yaml`` does)::

    from lightning.pytorch import Trainer
    from recipes import DeltaModule, DeltaSpec, Objective, TargetSpec

    module = DeltaModule(
        deltas=[DeltaSpec("model.layers_9.output", position="last")],
        objective=Objective(targets=[TargetSpec("The Eiffel Tower is located in the city of", " Rome")],
                            kl_prompts=["The capital of Germany is"], kl_weight=0.5, l2_weight=1e-4),
        lr=0.1)                                  # model_path=None: the embedded SmolLM2-135M-Instruct
    Trainer(max_steps=30).fit(module)
    module.export_intervention("runs/eiffel")    # safetensors + JSON; Intervention.load(...) reads it back
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler, Sampler

from gradpatch import AddPatch, PatchableGraph
from gradpatch.finite import StepGuard
from gradpatch.patches import Patch

from ..errors import RecipeConfigError
from ..generation import graph_logits, greedy_generate
from ..tokens import encode, left_pad, single_token_ids
from ..training.frozen import EMBEDDED_MODEL_LABEL, DtypeName, OptimizerName
from ..training.patches import PatchTrainingModule
from ..training.specs import as_spec, spec_dict
from .objectives import KIND_KL
from .rows import PromptRows, RowCollator, build_rows
from .specs import DeltaSpec, Objective, position_slice

__all__ = ["DeltaModule", "DtypeName", "EMBEDDED_MODEL_LABEL"]


class DeltaModule(PatchTrainingModule):
    """Learn AddPatch deltas (an :class:`gradpatch.Intervention`) at NodePaths of a frozen causal LM: the additive
    sibling of :class:`~recipes.interchange.InterventionModule` on their base
    :class:`~recipes.training.patches.PatchTrainingModule`.

    Its patches are ``AddPatch`` deltas at fixed positions (one per :class:`~recipes.delta.specs.DeltaSpec`), its
    objective is the :class:`~recipes.delta.specs.Objective` and its data are the objective's own prompts
    (:meth:`train_dataloader`). The model is wrapped in a :class:`gradpatch.PatchableGraph` extracted on a left-padded
    example (``input_ids``, ``attention_mask``, ``position_ids``; ``use_cache=False``) and frozen (see
    :class:`~recipes.training.frozen.FrozenGraphModule`). Each delta starts at zero; a step runs the patched model on a
    batch of rows (see :mod:`recipes.delta.rows`) and minimises the objective at their last position
    (:meth:`loss_terms`).

    Args:
        deltas: where the deltas go (:class:`~recipes.delta.specs.DeltaSpec` or mappings of its fields); each delta
            has the shape of the activation without its batch and sequence dimensions (``[d_model]`` for a residual
            stream).
        objective: what they are trained to do (:class:`~recipes.delta.specs.Objective` or a mapping).
        model_path: a ``save_pretrained`` directory or a ``.gguf`` file; ``None`` for the embedded
            SmolLM2-135M-Instruct.
        lr: learning rate.
        optimizer: ``"adam"``, ``"adamw"`` or ``"sgd"``.
        batch_size: rows per batch; ``None`` puts all rows in one batch (full-batch steps).
        max_norm: if set, each delta's L2 norm is clamped to it after every optimizer step.
        dtype: dtype the model is loaded in (deltas stay float32 and are cast when added).
        compile: as :class:`~recipes.training.patches.PatchTrainingModule` (``True``, or torch.compile's keyword
            arguments: the frozen graph runs compiled).
        _backbone: ``(model, tokenizer)`` already loaded (used instead of ``model_path``; not a CLI option, not
            saved in hyperparameters). :meth:`from_model` passes it.

    Raises:
        RecipeConfigError: no deltas, an objective without terms, a multi-token steering string, a node whose
            activation is not ``[batch, seq, ...]``, an unknown position, a ``batch_size`` below 1.
        KeyError: a NodePath that is not in the model's graph (the message lists the closest ones).
    """

    spec_type: ClassVar[type] = DeltaSpec
    spec_example: ClassVar[str] = "{node: ..., position: ...} to deltas"

    def __init__(
        self,
        deltas: list[DeltaSpec],
        objective: Objective,
        model_path: str | None = None,
        lr: float = 0.05,
        optimizer: OptimizerName = "adam",
        batch_size: int | None = None,
        max_norm: float | None = None,
        dtype: DtypeName = "float32",
        compile: bool | dict[str, Any] = False,
        *,
        _backbone: tuple[nn.Module, Any] | None = None,
    ) -> None:
        objective = as_spec(Objective, objective)
        if batch_size is not None and batch_size < 1:
            raise RecipeConfigError(f"batch_size must be >= 1 or null (all rows in one batch), got {batch_size}")
        term_names = objective.term_names()  # validates before the model is loaded
        super().__init__(interventions=deltas, objective=objective, model_path=model_path, lr=lr, optimizer=optimizer,
                         dtype=dtype, compile=compile, _backbone=_backbone)
        self.term_names = term_names
        self.model_path = model_path
        self.batch_size = batch_size
        self.max_norm = max_norm
        # This constructor's arguments, as plain data (checkpoints stay loadable with weights_only and give them back).
        self.save_hyperparameters(ignore=["_backbone"], logger=False)
        self.hparams["deltas"] = spec_dict(self.specs)
        self.hparams["objective"] = spec_dict(self.objective)
        self.rows = build_rows(self.tokenizer, self.objective)
        self.register_buffer("towards_ids", torch.tensor(single_token_ids(self.tokenizer, self.objective.towards),
                                                         dtype=torch.long), persistent=False)
        self.register_buffer("away_ids", torch.tensor(single_token_ids(self.tokenizer, self.objective.away),
                                                      dtype=torch.long), persistent=False)
        self.kl_reference: torch.Tensor | None = None  # [n_kl_prompts, V], computed on first use

    def build_patches(self, pg: nn.Module, spec: Any) -> list[Patch]:
        """One zero ``AddPatch`` delta at ``spec.node`` and ``spec.position`` (a
        :class:`~recipes.delta.specs.DeltaSpec`).

        Raises:
            RecipeConfigError: a node whose activation is not ``[batch, seq, ...]``, an unknown position.
            NodePathError: an unknown NodePath.
        """
        return [AddPatch(value=torch.zeros(_delta_shape(pg, spec.node)), slice=position_slice(spec.position))]

    # --- deltas --------------------------------------------------------------------------------------------

    @property
    def delta_specs(self) -> list[DeltaSpec]:
        """The :class:`~recipes.delta.specs.DeltaSpec` of each delta, in the order of ``deltas``."""
        return self.specs

    @property
    def delta_patches(self) -> list[AddPatch]:
        """The ``AddPatch`` of each delta, in the order of ``deltas``."""
        return self.patches  # type: ignore[return-value]

    @property
    def deltas(self) -> list[nn.Parameter]:
        """The delta parameters, in the order of ``deltas`` in the config; each has its activation's trailing
        shape (``[d_model]`` for a residual stream)."""
        return [patch.value for patch in self.delta_patches]

    def delta_names(self) -> list[str]:
        """``"<node>@<position>"`` per delta (TensorBoard tags)."""
        return [f"{spec.node}@{spec.position}" for spec in self.delta_specs]

    def step_guard(self) -> StepGuard:
        """Non-finite steps are reported as ``DeltaModule`` errors whose fix names ``lr`` and ``max_norm``."""
        return StepGuard("DeltaModule", f"lower the learning rate (lr={self.lr:g}) or bound the deltas with "
                                        f"max_norm; nothing was exported")

    # --- data ----------------------------------------------------------------------------------------------

    def train_dataloader(self) -> DataLoader:
        """Rows of the objective (see :func:`recipes.delta.rows.build_rows`), left-padded, ``batch_size`` per batch and
        process.

        With ``batch_size=None`` every step is full-batch: each of the ``W`` processes takes ``ceil(rows / W)`` rows
        (all rows in one batch on one process), in the same order every step. With a ``batch_size`` smaller than that,
        rows are shuffled (seeded). Under DDP the rows are split between processes by a ``DistributedSampler`` made
        here (Lightning's own would always shuffle). The rows are repeated so that one epoch covers the trainer's
        ``max_steps`` (one progress bar, one end-of-epoch checkpoint).
        """
        world, rank = self._world()
        size = self.batch_size or -(-len(self.rows) // world)
        shuffle = size * world < len(self.rows)
        dataset = PromptRows(self.rows * self._epoch_repeats(size * world))
        sampler: Sampler | None = None
        if world > 1:
            sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=shuffle, seed=_seed())
        elif shuffle:
            sampler = RandomSampler(dataset, generator=torch.Generator().manual_seed(_seed()))
        return DataLoader(dataset, batch_size=size, sampler=sampler, collate_fn=RowCollator(self.pad_id))

    def _world(self) -> tuple[int, int]:
        """``(world_size, global_rank)`` of the attached trainer (``(1, 0)`` without one)."""
        trainer = self._trainer
        if trainer is None:
            return 1, 0
        return int(trainer.world_size), int(trainer.global_rank)

    def _epoch_repeats(self, global_batch: int) -> int:
        """Passes over the rows per epoch: enough for ``trainer.max_steps`` steps (1 without a step limit)."""
        trainer = self._trainer
        max_steps = getattr(trainer, "max_steps", -1) if trainer is not None else -1
        if max_steps is None or max_steps < 1:
            return 1
        batches_per_pass = -(-len(self.rows) // global_batch)
        return max(1, -(-max_steps // batches_per_pass))

    # --- objective -----------------------------------------------------------------------------------------

    def loss_terms(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The objective on one batch of rows (:func:`recipes.delta.rows.collate_rows`): the graph runs once with the
        deltas patched in, and :meth:`Objective.loss_terms <recipes.delta.specs.Objective.loss_terms>` scores the
        last position's log-probabilities (the terms reach TensorBoard through
        :class:`~recipes.reports.InterventionLogger`).

        Returns:
            ``loss`` and the terms of :meth:`~recipes.delta.specs.Objective.loss_terms`.
        """
        with self.graph.patch(self.intervention):
            logits = self.logits(batch)
        log_probs = torch.log_softmax(logits[:, -1].float(), dim=-1)  # [B, V]
        needs_reference = "kl" in self.term_names and bool((batch["kind"] == KIND_KL).any())
        reference = self.reference_log_probs() if needs_reference else None
        return self.objective.loss_terms(log_probs, batch, self.towards_ids, self.away_ids, reference, self.deltas)

    def logits(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Logits of the graph on a left-padded batch (patches active in the caller apply): ``[B, S', V]`` where
        ``S'`` is 1 when the model supports ``logits_to_keep`` (only the last position is computed), else ``S``."""
        return graph_logits(self.graph, batch, self.call_kwargs)

    @torch.no_grad()
    def reference_log_probs(self) -> torch.Tensor:
        """Unpatched next-token log-probabilities after each KL prompt: ``[n_kl_prompts, V]`` float32 (computed
        once, on the graph's device)."""
        device = self.deltas[0].device
        if self.kl_reference is None or self.kl_reference.device != device:
            sequences = [encode(self.tokenizer, prompt) for prompt in self.objective.kl_prompts]
            count = len(sequences)
            sequences += [sequences[0]] * max(0, 2 - count)  # the size class of the graph's example: no new variant
            batch = {key: value.to(device) for key, value in left_pad(sequences, self.pad_id).items()}
            logits = self.logits(batch)[:count, -1]
            self.kl_reference = torch.log_softmax(logits.float(), dim=-1)
        return self.kl_reference

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        """Clamp each delta's norm to ``max_norm`` (when set) after the optimizer step."""
        if self.max_norm is None:
            return
        with torch.no_grad():
            for delta in self.deltas:
                norm = delta.norm()
                if norm > self.max_norm:
                    delta.mul_(self.max_norm / norm)

    # --- inspection ----------------------------------------------------------------------------------------

    def generation_prompts(self) -> list[str]:
        """The objective's prompts without repeats: targets', steering, then KL prompts."""
        prompts = [t.prompt for t in self.objective.targets] + self.objective.steer_prompts + self.objective.kl_prompts
        return list(dict.fromkeys(prompts))

    def generate(self, prompts: Sequence[str], max_new_tokens: int = 8, patched: bool = True) -> list[str]:
        """Greedy continuations of ``prompts``, with the intervention applied (``patched``) or not.

        Returns:
            The new text of each prompt.
        """
        if not patched:
            return greedy_generate(self.graph, self.tokenizer, prompts, max_new_tokens)
        with self.graph.patch(self.intervention):
            return greedy_generate(self.graph, self.tokenizer, prompts, max_new_tokens)

    def describe(self) -> dict[str, Any]:
        """Flat hyperparameters for TensorBoard: model, nodes, positions, objective terms and weights, optimizer."""
        objective = self.objective
        return {
            "model": self.model_label,
            "nodes": ", ".join(spec.node for spec in self.delta_specs),
            "positions": ", ".join(str(spec.position) for spec in self.delta_specs),
            "objective": " + ".join(self.term_names),
            "targets": "; ".join(f"{t.prompt!r} -> {t.target!r}" for t in objective.targets),
            "towards": ", ".join(repr(t) for t in objective.towards),
            "away": ", ".join(repr(t) for t in objective.away),
            "nll_weight": objective.nll_weight,
            "towards_weight": objective.towards_weight,
            "away_weight": objective.away_weight,
            "kl_weight": objective.kl_weight,
            "l2_weight": objective.l2_weight,
            "lr": self.lr,
            "optimizer": self.optimizer_name,
            "batch_size": self.batch_size or len(self.rows),
            "max_norm": self.max_norm if self.max_norm is not None else "none",
        }


def _seed() -> int:
    """The seed set by ``seed_everything`` (``PL_GLOBAL_SEED``), else 0."""
    return int(os.environ.get("PL_GLOBAL_SEED", "0"))


def _delta_shape(pg: PatchableGraph, node_path: str) -> torch.Size:
    """Shape of a delta at ``node_path``: the example activation's shape without batch and sequence dims.

    Raises:
        NodePathError: unknown NodePath (a KeyError naming the closest valid NodePaths).
        RecipeConfigError: the node is a graph, a container, or not at least 3-D.
    """
    shape = pg.node(node_path).tensor_shape
    if shape is None or len(shape) < 3:
        raise RecipeConfigError(
            f"NodePath {node_path!r} holds {'no tensor' if shape is None else f'a tensor of shape {tuple(shape)}'}; "
            f"deltas need a [batch, seq, ...] activation such as 'model.layers_5.output' or "
            f"'model.layers_5.mlp.down_proj.output'")
    return torch.Size(shape[2:])
