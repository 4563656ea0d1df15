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

import inspect
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler, Sampler

from gradpatch import AddPatch, Intervention, PatchableGraph
from gradpatch.finite import StepGuard

from .data import (KIND_KL, KIND_STEER, KIND_TARGET, PromptRows, RowCollator, build_rows, encode, left_pad,
                   single_token_ids)
from .errors import RecipeConfigError
from .frozen import EMBEDDED_MODEL_LABEL, FrozenGraphModule, OptimizerName
from .generation import graph_logits, greedy_generate
from .objectives import away_loss, kl_loss, l2_penalty, target_nll, towards_loss
from .specs import DeltaSpec, Objective, as_spec, position_slice, spec_dict

__all__ = ["DeltaModule", "DtypeName", "EMBEDDED_MODEL_LABEL"]

DtypeName = Literal["float32", "bfloat16", "float16"]


class DeltaModule(FrozenGraphModule):
    """Learn AddPatch deltas (an :class:`gradpatch.Intervention`) at NodePaths of a frozen causal LM.

    The model is wrapped in a :class:`gradpatch.PatchableGraph` built on the first training batch (left-padded
    ``input_ids``, ``attention_mask``, ``position_ids``; ``use_cache=False``) and frozen (see
    :class:`~recipes.frozen.FrozenGraphModule`). Each delta starts at zero; a step runs the patched model on a
    batch of rows (see :mod:`recipes.data`) and minimises the :class:`~recipes.specs.Objective` at their last
    position. The training data comes from the objective's prompts: :meth:`train_dataloader`.

    Args:
        deltas: where the deltas go (:class:`~recipes.specs.DeltaSpec` or mappings of its fields); each delta has the
            shape of the activation without its batch and sequence dimensions (``[d_model]`` for a residual stream).
        objective: what they are trained to do (:class:`~recipes.specs.Objective` or a mapping).
        model_path: a ``save_pretrained`` directory or a ``.gguf`` file; ``None`` for the embedded
            SmolLM2-135M-Instruct.
        lr: learning rate.
        optimizer: ``"adam"``, ``"adamw"`` or ``"sgd"``.
        batch_size: rows per batch; ``None`` puts all rows in one batch (full-batch steps).
        max_norm: if set, each delta's L2 norm is clamped to it after every optimizer step.
        dtype: dtype the model is loaded in (deltas stay float32 and are cast when added).
        _backbone: ``(model, tokenizer)`` already loaded (used instead of ``model_path``; not a CLI option, not
            saved in hyperparameters). :meth:`from_model` passes it.

    Raises:
        RecipeConfigError: no deltas, an objective without terms, a multi-token steering string, a node whose
            activation is not ``[batch, seq, ...]``, an unknown position, a ``batch_size`` below 1.
        KeyError: a NodePath that is not in the model's graph (the message lists the closest ones).
    """

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
        *,
        _backbone: tuple[nn.Module, Any] | None = None,
    ) -> None:
        super().__init__(lr=lr, optimizer=optimizer)
        self.delta_specs = [as_spec(DeltaSpec, spec) for spec in deltas]
        self.objective = as_spec(Objective, objective)
        if not self.delta_specs:
            raise RecipeConfigError("no deltas configured: add at least one {node: ..., position: ...} to deltas")
        if batch_size is not None and batch_size < 1:
            raise RecipeConfigError(f"batch_size must be >= 1 or null (all rows in one batch), got {batch_size}")
        self.term_names = self.objective.term_names()
        self.model_path = model_path
        self.batch_size = batch_size
        self.max_norm = max_norm
        self.save_hyperparameters(ignore=["_backbone"], logger=False)
        self.hparams["deltas"] = spec_dict(self.delta_specs)  # plain data: checkpoints stay loadable weights_only
        self.hparams["objective"] = spec_dict(self.objective)

        model = self.load_backbone(model_path, dtype, _backbone)
        tokenizer = self.tokenizer
        self.rows = build_rows(tokenizer, self.objective)
        self.call_kwargs = _call_constants(model)
        example = RowCollator(self.pad_id)(self.rows[: self.batch_size or len(self.rows)])
        with torch.no_grad():
            pg = PatchableGraph(model, example["input_ids"], attention_mask=example["attention_mask"],
                                position_ids=example["position_ids"], **self.call_kwargs)
        self.example_batch_size = int(example["input_ids"].shape[0])
        self.attach_graph(pg)

        self.delta_patches: list[AddPatch] = []
        patches: dict[str, list[AddPatch]] = {}
        for spec in self.delta_specs:
            patch = AddPatch(value=torch.zeros(_delta_shape(pg, spec.node)), slice=position_slice(spec.position))
            patches.setdefault(spec.node, []).append(patch)
            self.delta_patches.append(patch)
        self.intervention = Intervention(patches)  # turns each value into an nn.Parameter (patch.value)
        self.register_buffer("towards_ids", torch.tensor(single_token_ids(tokenizer, self.objective.towards),
                                                         dtype=torch.long), persistent=False)
        self.register_buffer("away_ids", torch.tensor(single_token_ids(tokenizer, self.objective.away),
                                                      dtype=torch.long), persistent=False)
        self.kl_reference: torch.Tensor | None = None  # [n_kl_prompts, V], computed on first use

    @classmethod
    def from_model(cls, model: nn.Module, tokenizer: Any, **config: Any) -> "DeltaModule":
        """A DeltaModule on a model already in memory (tests, notebooks).

        Args:
            model: a causal LM (``eval()`` mode is kept).
            tokenizer: its tokenizer.
            config: the other constructor arguments (``deltas``, ``objective``, ``lr``, ...).
        """
        return cls(**config, _backbone=(model, tokenizer))

    # --- deltas --------------------------------------------------------------------------------------------

    @property
    def deltas(self) -> list[nn.Parameter]:
        """The delta parameters, in the order of ``deltas`` in the config; each has its activation's trailing
        shape (``[d_model]`` for a residual stream)."""
        return [patch.value for patch in self.delta_patches]

    def delta_names(self) -> list[str]:
        """``"<node>@<position>"`` per delta (TensorBoard tags)."""
        return [f"{spec.node}@{spec.position}" for spec in self.delta_specs]

    def export_intervention(self, directory: str | Path) -> Path:
        """Write the trained intervention in the engine's format (``intervention.json`` + ``.safetensors``,
        atomically, with the model's fingerprint).

        Load it back with ``Intervention.load(directory, graph=pg, model=model)`` and apply it with
        ``pg.patch(...)``; it gives the outputs this module's patched model gives.

        Returns:
            ``directory``.

        Raises:
            NonFiniteError: a delta holds NaN or inf (nothing is written).
        """
        return self.intervention.save(directory, model=self.__dict__["_model"])

    @property
    def model(self) -> nn.Module:
        """The wrapped model (frozen)."""
        return self.__dict__["_model"]

    def step_guard(self) -> StepGuard:
        """Non-finite steps are reported as ``DeltaModule`` errors whose fix names ``lr`` and ``max_norm``."""
        return StepGuard("DeltaModule", f"lower the learning rate (lr={self.lr:g}) or bound the deltas with "
                                        f"max_norm; nothing was exported")

    # --- data ----------------------------------------------------------------------------------------------

    def train_dataloader(self) -> DataLoader:
        """Rows of the objective (see :func:`recipes.data.build_rows`), left-padded, ``batch_size`` per batch and
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

    def logits(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Logits of the graph on a left-padded batch (patches active in the caller apply): ``[B, S', V]`` where
        ``S'`` is 1 when the model supports ``logits_to_keep`` (only the last position is computed), else ``S``."""
        return graph_logits(self.graph, batch, self.call_kwargs)

    def loss_terms(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The objective on one batch of rows (see :func:`recipes.data.collate_rows`).

        Returns:
            ``loss`` (weighted sum), the unweighted terms present in the batch (``nll``, ``towards``, ``away``,
            ``kl``, ``l2``), the probabilities ``p_target``, ``p_towards``, ``p_away`` (detached) and
            ``norm/<i>``, the L2 norm of delta ``i`` (detached).
        """
        with self.graph.patch(self.intervention):
            logits = self.logits(batch)
        log_probs = torch.log_softmax(logits[:, -1].float(), dim=-1)  # [B, V]
        kind = batch["kind"]
        objective = self.objective
        terms: dict[str, torch.Tensor] = {}
        loss = log_probs.new_zeros(())
        rows = kind == KIND_TARGET
        if "nll" in self.term_names and bool(rows.any()):
            terms["nll"], terms["p_target"] = target_nll(log_probs[rows], batch["target"][rows], batch["weight"][rows])
            loss = loss + objective.nll_weight * terms["nll"]
        rows = kind == KIND_STEER
        if bool(rows.any()):
            if "towards" in self.term_names:
                terms["towards"], terms["p_towards"] = towards_loss(log_probs[rows], self.towards_ids)
                loss = loss + objective.towards_weight * terms["towards"]
            if "away" in self.term_names:
                terms["away"], terms["p_away"] = away_loss(log_probs[rows], self.away_ids)
                loss = loss + objective.away_weight * terms["away"]
        rows = kind == KIND_KL
        if "kl" in self.term_names and bool(rows.any()):
            reference = self.reference_log_probs()[batch["kl_index"][rows]]
            terms["kl"] = kl_loss(reference, log_probs[rows])
            loss = loss + objective.kl_weight * terms["kl"]
        if "l2" in self.term_names:
            terms["l2"] = l2_penalty(self.deltas)
            loss = loss + objective.l2_weight * terms["l2"]
        for i, delta in enumerate(self.deltas):
            terms[f"norm/{i}"] = delta.detach().norm()
        terms["loss"] = loss
        return terms

    @torch.no_grad()
    def reference_log_probs(self) -> torch.Tensor:
        """Unpatched next-token log-probabilities after each KL prompt: ``[n_kl_prompts, V]`` float32 (computed
        once, on the graph's device)."""
        device = self.deltas[0].device
        if self.kl_reference is None or self.kl_reference.device != device:
            sequences = [encode(self.tokenizer, prompt) for prompt in self.objective.kl_prompts]
            count = len(sequences)
            sequences += [sequences[0]] * max(0, min(self.example_batch_size, 2) - count)  # keep the size class
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


def _call_constants(model: nn.Module) -> dict[str, Any]:
    """Constant keyword arguments of every graph call: ``use_cache=False``, and ``logits_to_keep=1`` (only the last
    position's logits: the recipes score nothing else) when the model's ``forward`` takes it."""
    constants: dict[str, Any] = {"use_cache": False}
    if "logits_to_keep" in inspect.signature(model.forward).parameters:
        constants["logits_to_keep"] = 1
    return constants


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
