"""InterventionModule: train trainable interchange patches (DAS, Boundless DAS, sigmoid masks) with Lightning.

Example (what ``recipes/configs/das_country.yaml`` does)::

    from lightning.pytorch import Trainer
    from recipes import CounterfactualDataModule, InterventionModule

    module = InterventionModule(interventions=[{"node": "model.layers_8.output", "kind": "rotated", "dim": 16}])
    data = CounterfactualDataModule("pairs_train.jsonl", "pairs_eval.jsonl", batch_size=16)
    Trainer(max_steps=200).fit(module, datamodule=data)
    module.evaluate(data.eval_records)           # IIA
    module.export_intervention("runs/das")       # safetensors + JSON, Intervention.load(...) reads it back

Each step encodes a batch of counterfactual records (:mod:`recipes.interchange.counterfactual`), runs base and source
rows in one forward pass with the patches interchanging at the records' positions
(:func:`gradpatch.interventions.interchange.interchange`) and minimises the objective
(:class:`~recipes.interchange.objectives.IITObjective` by default) on the resulting log-probabilities. IIA on the eval
file is the validation metric ``iia``; the loss terms, ``iia``, the Boundless boundary width and the mask density go
to the trainer's logger (TensorBoard in the configs).

The module is a sibling of :class:`~recipes.delta.DeltaModule` (``AddPatch`` deltas on prompts) and
:class:`~recipes.reft.ReFTModule` (LoReFT, DiReFT, steering vectors on continuations or preferences) on their base
:class:`~recipes.training.patches.PatchTrainingModule` (specs → patches → Intervention, export and load,
``from_model``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

import torch
from torch import nn

from gradpatch.files.atomic import atomic_write_text
from gradpatch.interventions.interchange import (InterchangeSide, Position, check_interchange_node, check_sides,
                                                 interchange,
                                   interchange_logits)
from gradpatch.model_io import model_device
from gradpatch.patches import Patch
from gradpatch.interventions.subspace import (BoundlessSubspacePatch, FullInterchangePatch, RotatedSubspacePatch,
                                SigmoidMaskPatch, TrainablePatch)

from ..errors import RecipeConfigError
from ..generation import graph_logits
from ..tokens import left_pad, single_token_ids
from ..training.frozen import DtypeName, OptimizerName, term_scalars
from ..training.patches import PatchTrainingModule
from ..training.specs import spec_dict
from .counterfactual import CounterfactualRecord
from .objectives import IITObjective, InterventionObjective

__all__ = ["Encoded", "InterchangeSpec", "InterventionModule", "PatchKind"]

PatchKind = Literal["rotated", "boundless", "mask", "full"]


@dataclass
class InterchangeSpec:
    """One trainable interchange patch.

    Attributes:
        node: NodePath of a ``[batch, seq, d]`` activation (e.g. ``"model.layers_8.output"``, the residual stream).
        kind: ``"rotated"`` (DAS, :class:`~gradpatch.interventions.RotatedSubspacePatch`), ``"boundless"`` (Boundless
            DAS), ``"mask"`` (:class:`~gradpatch.interventions.SigmoidMaskPatch`) or ``"full"`` (full-vector
            interchange, nothing to train: the exact baseline).
        dim: subspace size ``k`` of ``"rotated"`` (1 ≤ k ≤ d).
        boundary: initial β of ``"boundless"``.
        init: initial mask logit of ``"mask"``.
    """

    node: str
    kind: PatchKind = "rotated"
    dim: int = 1
    boundary: float = 0.5
    init: float = 0.0


@dataclass
class Encoded:
    """A tokenized batch of records: base and source sides (:class:`gradpatch.interventions.InterchangeSide`) and the
    label token ids ``[B]``."""

    base: InterchangeSide
    source: InterchangeSide
    labels: torch.Tensor


def build_patch(spec: InterchangeSpec, width: int) -> TrainablePatch:
    """The patch a spec describes, for a node of width ``width``.

    Raises:
        SubspaceConfigError: a subspace wider than the node.
        RecipeConfigError: an unknown kind.
    """
    if spec.kind == "rotated":
        return RotatedSubspacePatch(width, spec.dim)
    if spec.kind == "boundless":
        return BoundlessSubspacePatch(width, spec.boundary)
    if spec.kind == "mask":
        return SigmoidMaskPatch(width, spec.init)
    if spec.kind == "full":
        return FullInterchangePatch(width)
    raise RecipeConfigError(f"intervention kind {spec.kind!r} is not one of 'rotated', 'boundless', 'mask', 'full'")


class InterventionModule(PatchTrainingModule):
    """Train trainable interchange patches at NodePaths of a frozen causal LM on counterfactual records.

    Args:
        interventions: where and which patches (:class:`InterchangeSpec` or mappings of its fields); all read the
            record's source.
        objective: an :class:`~recipes.interchange.objectives.InterventionObjective` (default: IIT cross-entropy).
        model_path: a ``save_pretrained`` directory or ``.gguf`` file; ``None`` for the embedded SmolLM2-135M-Instruct.
        lr: learning rate.
        optimizer: ``"adam"``, ``"adamw"`` or ``"sgd"``.
        position: where records without positions or subjects are interchanged: an index (negative from the end),
            ``"last"`` or ``None`` (every token: base and source must have equal token lengths).
        temperature_start, temperature_end: τ of Boundless/mask patches, annealed linearly over ``max_steps``.
        shared_batch: base and source rows in one forward pass (``True``), or a source pass without gradients that
            stops at the last patched node, then the base pass (``False``;
            :func:`gradpatch.interventions.interchange.interchange`); ``None`` (default): one pass on GPUs, where fewer
            launches pay, the two passes on the CPU, where compute does (the shared batch carries the source rows
            through the later layers and the backward pass: 1.73× the seconds per DAS step at layer 10 of SmolLM2, batch
            16, one CPU thread; ``benchmarks/interventions/das_layout.py``).
        dtype: dtype the model is loaded in (patches stay float32).
        compile: as :class:`~recipes.training.patches.PatchTrainingModule` (``True``, or torch.compile's keyword
            arguments: the frozen graph runs compiled).
        _backbone: ``(model, tokenizer)`` already loaded (tests, notebooks; see :meth:`from_model`).

    Raises:
        RecipeConfigError: no interventions, an unknown kind, temperatures that are not positive.
        SubspaceConfigError: a node whose activation is not ``[batch, seq, d]``, a subspace wider than its node.
        NodePathError: an unknown NodePath (the message lists the closest ones).
    """

    spec_type: ClassVar[type] = InterchangeSpec
    spec_example: ClassVar[str] = "{node: ..., kind: ..., dim: ...}"

    def __init__(self, interventions: list[InterchangeSpec], objective: InterventionObjective | None = None,
                 model_path: str | None = None, lr: float = 1e-3, optimizer: OptimizerName = "adam",
                 position: Position = "last", temperature_start: float = 50.0, temperature_end: float = 0.1,
                 shared_batch: bool | None = None, dtype: DtypeName = "float32",
                 compile: bool | dict[str, Any] = False, *, _backbone: tuple[nn.Module, Any] | None = None) -> None:
        if not (temperature_start > 0 and temperature_end > 0):
            raise RecipeConfigError(f"temperatures must be > 0, got {temperature_start}, {temperature_end}")
        super().__init__(interventions, objective if objective is not None else IITObjective(), model_path=model_path,
                         lr=lr, optimizer=optimizer, dtype=dtype, compile=compile, _backbone=_backbone)
        self.position = position
        self.shared_batch = shared_batch
        self.temperatures = (float(temperature_start), float(temperature_end))
        self.save_hyperparameters(ignore=["_backbone", "objective"], logger=False)
        self.hparams["interventions"] = spec_dict(self.specs)

    @property
    def patches(self) -> list[TrainablePatch]:
        """The interchange patches (each reads the record's source), in the order of ``interventions``."""
        return [patch for patch in self.built_patches if isinstance(patch, TrainablePatch)]

    def build_patches(self, pg: nn.Module, spec: Any) -> list[Patch]:
        """The patches of one spec at ``spec.node`` of ``pg`` (here one :func:`build_patch` of an
        :class:`InterchangeSpec`).

        Raises:
            SubspaceConfigError: a node whose activation is not ``[batch, seq, d]``, a subspace wider than its node.
            RecipeConfigError: an unknown kind.
            NodePathError: an unknown NodePath.
        """
        return [build_patch(spec, check_interchange_node(pg, spec.node))]

    # --- data ----------------------------------------------------------------------------------------------

    def encode(self, records: Sequence[CounterfactualRecord]) -> Encoded:
        """Tokenize records: positions from subjects, then the records' positions, then :attr:`position`.

        Raises:
            RecipeConfigError: a label of more than one token.
            SubspaceConfigError: a subject not in its prompt, a position outside it, base and source of different
                lengths without positions.
        """
        def side(prompts: list[str], positions: list[Any], subjects: list[str | None]) -> InterchangeSide:
            chosen = [self.position if p is None else p for p in positions]
            return InterchangeSide.encode(self.tokenizer, prompts, chosen, subjects)

        base = side([r.base for r in records], [r.base_position for r in records],
                    [r.base_subject for r in records])
        source = side([r.source for r in records], [r.source_position for r in records],
                      [r.source_subject for r in records])
        try:
            labels = single_token_ids(self.tokenizer, [r.label for r in records])
        except RecipeConfigError as error:
            raise RecipeConfigError(f"a counterfactual label must be one token: {error}") from None
        return Encoded(base, source, torch.tensor(labels, dtype=torch.long))

    def check_records(self, records: Sequence[CounterfactualRecord], batch_size: int = 256) -> None:
        """Encode every record and check base/source agreement, so bad input fails before training.

        Raises:
            RecipeConfigError, SubspaceConfigError: as :meth:`encode` and
            :func:`gradpatch.interventions.interchange.interchange`.
        """
        for start in range(0, len(records), batch_size):
            encoded = self.encode(records[start:start + batch_size])
            check_sides(encoded.base, [encoded.source])

    # --- forward passes ------------------------------------------------------------------------------------

    def interchange_log_probs(self, encoded: Encoded, patches: Sequence[TrainablePatch] | None = None) -> torch.Tensor:
        """Next-token log-probabilities at each base prompt's end with the patches interchanging: ``[B, V]``
        float32 (``patches``: others than :attr:`patches` at the same nodes, e.g. full interchange)."""
        chosen = self.patches if patches is None else list(patches)
        mapping: dict[str, list[TrainablePatch]] = {}
        for spec, patch in zip(self.specs, chosen):
            mapping.setdefault(spec.node, []).append(patch)
        shared = self.shared_batch if self.shared_batch is not None else model_device(self.graph).type != "cpu"
        output = interchange(self.graph, mapping, encoded.base, encoded.source, self.pad_id, shared_batch=shared,
                             **self.call_kwargs)
        return torch.log_softmax(interchange_logits(output, len(encoded.base.input_ids))[:, -1].float(), dim=-1)

    def base_log_probs(self, encoded: Encoded) -> torch.Tensor:
        """Unpatched next-token log-probabilities at each base prompt's end: ``[B, V]`` float32."""
        logits = graph_logits(self.graph, left_pad(encoded.base.input_ids, self.pad_id), self.call_kwargs)
        return torch.log_softmax(logits[:, -1].float(), dim=-1)

    # --- training ------------------------------------------------------------------------------------------

    def temperature(self) -> float:
        """τ at the current step: linear from ``temperature_start`` to ``temperature_end`` over ``max_steps``."""
        start, end = self.temperatures
        max_steps = getattr(self._trainer, "max_steps", -1) if self._trainer is not None else -1
        if not max_steps or max_steps < 2:
            return end
        fraction = min(1.0, self.global_step / (max_steps - 1))
        return start + (end - start) * fraction

    def loss_terms(self, batch: Sequence[CounterfactualRecord]) -> dict[str, torch.Tensor]:
        """The objective's terms on a batch of records (:meth:`InterventionObjective.loss_terms`): τ of the patches
        set to :meth:`temperature`, the records encoded, the interchanged log-probabilities ``[B, V]`` (and, when the
        objective reads them, the unpatched ones) and the patches' penalty handed to the objective."""
        tau = self.temperature()
        for patch in self.patches:
            patch.temperature = tau
        encoded = self.encode(batch)
        log_probs = self.interchange_log_probs(encoded)
        reference = None
        if self.objective.reads_reference:
            with torch.no_grad():
                reference = self.base_log_probs(encoded)
        penalty = torch.stack([patch.penalty().to(log_probs.device) for patch in self.patches]).sum()
        return self.objective.loss_terms(log_probs, encoded.labels, reference, penalty)

    def step_logs(self, terms: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """What each step logs to the trainer's logger: ``train/<term>``, ``temperature`` and each patch's statistics
        (``boundary_width/<i>``, ``mask_density/<i>``), scalars."""
        logged = term_scalars(terms, "train/") | {"temperature": torch.tensor(self.temperature())}
        for i, patch in enumerate(self.patches):
            logged.update({f"{name}/{i}": torch.tensor(value) for name, value in patch.stats().items()})
        return logged

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        """IIA of the batch (logged as ``iia``, averaged over the eval file)."""
        self.log("iia", self.iia(batch), on_step=False, on_epoch=True, prog_bar=True, batch_size=len(batch))

    @torch.no_grad()
    def iia(self, records: Sequence[CounterfactualRecord], patches: Sequence[TrainablePatch] | None = None,
            batch_size: int = 64) -> torch.Tensor:
        """Interchange intervention accuracy: the fraction of records whose interchanged prediction (argmax at the
        base prompt's end) is the label (scalar)."""
        patches = self.patches if patches is None else patches
        hits = 0
        for start in range(0, len(records), batch_size):
            encoded = self.encode(records[start:start + batch_size])
            predicted = self.interchange_log_probs(encoded, patches).argmax(-1).cpu()
            hits += int((predicted == encoded.labels).sum())
        return torch.tensor(hits / max(1, len(records)))

    def evaluate(self, records: Sequence[CounterfactualRecord]) -> dict[str, Any]:
        """IIA of the trained patches and of full-vector interchange at the same nodes (the exact comparison).

        Returns:
            ``{"iia", "full_interchange_iia", "examples", "node", "kind", "dim"}`` (``dim``: the subspace size, the
            learned boundary width for Boundless DAS, the number of mask entries above 0.5 for a sigmoid mask).
        """
        patches = self.patches
        full = [FullInterchangePatch(patch.width) for patch in patches]
        first, spec = patches[0], self.specs[0]
        dim = (spec.dim if spec.kind == "rotated" else round(first.stats()["boundary_width"]) if spec.kind ==
               "boundless" else int((first.mask() > 0.5).sum()) if spec.kind == "mask" else first.width)
        return {"iia": float(self.iia(records)), "full_interchange_iia": float(self.iia(records, full)),
                "examples": len(records), "node": spec.node, "kind": spec.kind, "dim": dim}

    def write_metrics(self, directory: str | Path, records: Sequence[CounterfactualRecord]) -> dict[str, Any]:
        """Write ``metrics.json`` (:meth:`evaluate` on ``records`` plus the training steps) atomically.

        Returns:
            The metrics.
        """
        metrics = {**self.evaluate(records), "steps": int(self.global_step), "lr": self.lr,
                   "nodes": [spec.node for spec in self.specs]}
        atomic_write_text(Path(directory) / "metrics.json", json.dumps(metrics, indent=2))
        return metrics
