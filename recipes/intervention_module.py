"""InterventionModule: train trainable interchange patches (DAS, Boundless DAS, sigmoid masks) with Lightning.

Example (what ``recipes/configs/das_country.yaml`` does)::

    from lightning.pytorch import Trainer
    from recipes import CounterfactualDataModule, InterventionModule

    module = InterventionModule(interventions=[{"node": "model.layers_8.output", "kind": "rotated", "dim": 16}])
    data = CounterfactualDataModule("pairs_train.jsonl", "pairs_eval.jsonl", batch_size=16)
    Trainer(max_steps=200).fit(module, datamodule=data)
    module.evaluate(data.eval_records)           # IIA
    module.export_intervention("runs/das")       # safetensors + JSON, Intervention.load(...) reads it back

Each step encodes a batch of counterfactual records (:mod:`recipes.counterfactual`), runs base and source rows in
one forward pass with the patches interchanging at the records' positions (:func:`gradpatch.interchange.interchange`)
and minimises the objective (:class:`~recipes.intervention_objectives.IITObjective` by default). IIA on the eval
file is the validation metric ``iia``; the loss terms, ``iia``, the Boundless boundary width and the mask density go
to the trainer's logger (TensorBoard in the configs).

The module trains whatever patches its specs build (:meth:`InterventionModule.build_patches`) against whatever its
objective returns: :class:`~recipes.delta_module.DeltaModule` is the additive special case (``AddPatch`` deltas at
fixed positions, the delta :class:`~recipes.specs.Objective`, rows of prompts as data), and
:class:`~recipes.reft_module.ReFTModule` trains patches that edit the representation itself (LoReFT, DiReFT, steering
vectors) on continuation NLL or BiPO's preference loss.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

import torch
from torch import nn

from gradpatch import Intervention
from gradpatch.files import atomic_write_text
from gradpatch.interchange import InterchangeSide, Position, check_interchange_node, interchange, interchange_logits
from gradpatch.model_io import model_device
from gradpatch.patches import Patch
from gradpatch.reft import ReFTPatch
from gradpatch.subspace import (BoundlessSubspacePatch, FullInterchangePatch, RotatedSubspacePatch,
                                SigmoidMaskPatch, TrainablePatch)

from .counterfactual import CounterfactualRecord
from .data import left_pad, single_token_ids
from .errors import RecipeConfigError
from .frozen import DtypeName, FrozenGraphModule, OptimizerName, call_constants
from .generation import graph_logits
from .intervention_objectives import IITObjective, InterventionObjective
from .specs import as_spec, spec_dict

__all__ = ["Encoded", "InterchangeSpec", "InterventionModule", "PatchKind"]

PatchKind = Literal["rotated", "boundless", "mask", "full"]


@dataclass
class InterchangeSpec:
    """One trainable interchange patch.

    Attributes:
        node: NodePath of a ``[batch, seq, d]`` activation (e.g. ``"model.layers_8.output"``, the residual stream).
        kind: ``"rotated"`` (DAS, :class:`~gradpatch.subspace.RotatedSubspacePatch`), ``"boundless"`` (Boundless
            DAS), ``"mask"`` (:class:`~gradpatch.subspace.SigmoidMaskPatch`) or ``"full"`` (full-vector interchange,
            nothing to train: the exact baseline).
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
    """A tokenized batch of records: base and source sides (:class:`gradpatch.interchange.InterchangeSide`) and the
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


class InterventionModule(FrozenGraphModule):
    """Train trainable interchange patches at NodePaths of a frozen causal LM on counterfactual records.

    A subclass trains other patches by naming its spec type (:attr:`spec_type`) and overriding
    :meth:`build_patches` (see :class:`~recipes.delta_module.DeltaModule`, :class:`~recipes.reft_module.ReFTModule`);
    the interchange methods (:meth:`interchange_log_probs`, :meth:`iia`, :meth:`evaluate`) need patches that read a
    source.

    Args:
        interventions: where and which patches (:class:`InterchangeSpec` or mappings of its fields); all read the
            record's source.
        objective: an :class:`~recipes.intervention_objectives.InterventionObjective` (default: IIT cross-entropy).
        model_path: a ``save_pretrained`` directory or ``.gguf`` file; ``None`` for the embedded SmolLM2-135M-Instruct.
        lr: learning rate.
        optimizer: ``"adam"``, ``"adamw"`` or ``"sgd"``.
        position: where records without positions or subjects are interchanged: an index (negative from the end),
            ``"last"`` or ``None`` (every token: base and source must have equal token lengths).
        temperature_start, temperature_end: τ of Boundless/mask patches, annealed linearly over ``max_steps``.
        shared_batch: base and source rows in one forward pass (``True``), or a source pass without gradients that
            stops at the last patched node, then the base pass (``False``; :func:`gradpatch.interchange.interchange`);
            ``None`` (default): one pass on GPUs, where fewer launches pay, the two passes on the CPU, where compute
            does (the shared batch carries the source rows through the later layers and the backward pass: 1.73× the
            seconds per DAS step at layer 10 of SmolLM2, batch 16, one CPU thread; ``benchmarks/das_layout.py``).
        dtype: dtype the model is loaded in (patches stay float32).
        _backbone: ``(model, tokenizer)`` already loaded (tests, notebooks; see :meth:`from_model`).

    Raises:
        RecipeConfigError: no interventions, an unknown kind, temperatures that are not positive.
        SubspaceConfigError: a node whose activation is not ``[batch, seq, d]``, a subspace wider than its node.
        NodePathError: an unknown NodePath (the message lists the closest ones).
    """

    #: The dataclass of ``interventions`` (mappings are converted to it).
    spec_type: ClassVar[type] = InterchangeSpec

    def __init__(self, interventions: list[InterchangeSpec], objective: InterventionObjective | None = None,
                 model_path: str | None = None, lr: float = 1e-3, optimizer: OptimizerName = "adam",
                 position: Position = "last", temperature_start: float = 50.0, temperature_end: float = 0.1,
                 shared_batch: bool | None = None, dtype: DtypeName = "float32", *,
                 _backbone: tuple[nn.Module, Any] | None = None) -> None:
        super().__init__(lr=lr, optimizer=optimizer)
        self.specs = [as_spec(self.spec_type, spec) for spec in interventions]
        if not self.specs:
            raise RecipeConfigError("no interventions configured: add at least one {node: ..., kind: ..., dim: ...}")
        if not (temperature_start > 0 and temperature_end > 0):
            raise RecipeConfigError(f"temperatures must be > 0, got {temperature_start}, {temperature_end}")
        self.objective = objective if objective is not None else IITObjective()
        self.position = position
        self.shared_batch = shared_batch
        self.temperatures = (float(temperature_start), float(temperature_end))
        self.save_hyperparameters(ignore=["_backbone", "objective"], logger=False)
        self.hparams["interventions"] = spec_dict(self.specs)
        model = self.load_backbone(model_path, dtype, _backbone)
        self.call_kwargs = self.graph_call_kwargs(model)
        pg = self.attach_left_padded_graph(model, **self.call_kwargs)
        self.built_patches: list[Patch] = []  # in the order of the specs
        patches: dict[str, list[Patch]] = {}
        for spec in self.specs:
            built = self.build_patches(pg, spec)
            patches.setdefault(spec.node, []).extend(built)
            self.built_patches.extend(built)
        self.intervention = Intervention(patches)  # tensor values become nn.Parameters, trainable patches submodules

    def graph_call_kwargs(self, model: nn.Module) -> dict[str, Any]:
        """The constant keyword arguments of every graph call, fixed when the graph is extracted
        (:func:`~recipes.frozen.call_constants`: ``use_cache=False`` and, where the model takes it,
        ``logits_to_keep=1``: the interchange objectives score the last position only)."""
        return call_constants(model)

    def build_patches(self, pg: nn.Module, spec: Any) -> list[Patch]:
        """The patches of one spec at ``spec.node`` of ``pg`` (here one :func:`build_patch` of an
        :class:`InterchangeSpec`).

        Raises:
            SubspaceConfigError: a node whose activation is not ``[batch, seq, d]``, a subspace wider than its node.
            RecipeConfigError: an unknown kind.
            NodePathError: an unknown NodePath.
        """
        return [build_patch(spec, check_interchange_node(pg, spec.node))]

    @classmethod
    def from_model(cls, model: nn.Module, tokenizer: Any, **config: Any) -> "InterventionModule":
        """An InterventionModule on a model already in memory (the other constructor arguments in ``config``)."""
        return cls(**config, _backbone=(model, tokenizer))

    @property
    def patches(self) -> list[Patch]:
        """The patches, in the order of ``interventions``."""
        return list(self.built_patches)

    def interchange_patches(self) -> list[TrainablePatch]:
        """:attr:`patches`, checked to read a source.

        Raises:
            RecipeConfigError: a patch that is not a :class:`~gradpatch.subspace.TrainablePatch` or is a
                :class:`~gradpatch.reft.ReFTPatch` (an ``AddPatch`` delta, a LoReFT edit read no source: there is
                nothing to interchange).
        """
        others = sorted({type(p).__name__ for p in self.patches
                         if not isinstance(p, TrainablePatch) or isinstance(p, ReFTPatch)})
        if others:
            raise RecipeConfigError(f"{type(self).__name__} holds {', '.join(others)} patches, which read no source: "
                                    f"interchange and IIA need interchange patches (InterchangeSpec kinds "
                                    f"'rotated', 'boundless', 'mask', 'full') in an InterventionModule")
        return self.patches  # type: ignore[return-value]

    @property
    def model(self) -> nn.Module:
        """The wrapped model (frozen)."""
        return self.__dict__["_model"]

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
            RecipeConfigError, SubspaceConfigError: as :meth:`encode` and :func:`gradpatch.interchange.interchange`.
        """
        from gradpatch.interchange import check_sides

        for start in range(0, len(records), batch_size):
            encoded = self.encode(records[start:start + batch_size])
            check_sides(encoded.base, [encoded.source])

    def on_fit_start(self) -> None:
        """Check the data module's records (train and eval) before the first step."""
        data = getattr(self.trainer, "datamodule", None)
        for name in ("train_records", "eval_records"):
            self.check_records(getattr(data, name, None) or [])

    # --- forward passes ------------------------------------------------------------------------------------

    def interchange_log_probs(self, encoded: Encoded, patches: Sequence[TrainablePatch] | None = None) -> torch.Tensor:
        """Next-token log-probabilities at each base prompt's end with the patches interchanging: ``[B, V]``
        float32 (``patches``: others than :attr:`patches` at the same nodes, e.g. full interchange)."""
        chosen = self.interchange_patches() if patches is None else list(patches)
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

    def loss_terms(self, batch: Any) -> dict[str, torch.Tensor]:
        """The objective's terms on ``batch`` (:meth:`InterventionObjective.loss_terms`), with τ of the trainable
        patches set to :meth:`temperature` first."""
        tau = self.temperature()
        for patch in self.patches:
            if isinstance(patch, TrainablePatch):
                patch.temperature = tau
        return self.objective.loss_terms(self, batch)

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        """One step (see :class:`~recipes.frozen.FrozenGraphModule`), logging ``train/<term>`` and
        :meth:`step_statistics` to the logger."""
        result = super().training_step(batch, batch_idx)
        logged = {f"train/{name}": value for name, value in result["terms"].items() if value.numel() == 1}
        logged.update(self.step_statistics())
        self.log_dict(logged, on_step=True, on_epoch=False, batch_size=len(batch))
        return result

    def step_statistics(self) -> dict[str, torch.Tensor]:
        """What each step logs beside the loss terms: ``temperature`` and each patch's statistics
        (``boundary_width/<i>``, ``mask_density/<i>``), scalars."""
        logged = {"temperature": torch.tensor(self.temperature())}
        for i, patch in enumerate(self.patches):
            if isinstance(patch, TrainablePatch):
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
        patches = self.interchange_patches() if patches is None else patches  # refused before any encoding
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
        patches = self.interchange_patches()
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

    def export_intervention(self, directory: str | Path) -> Path:
        """Write the trained patches (``intervention.json`` + ``.safetensors``, with the model's fingerprint).

        Raises:
            NonFiniteError: a parameter holds NaN or inf (nothing is written).
        """
        return self.intervention.save(directory, model=self.model)

    def load_intervention(self, directory: str | Path) -> None:
        """Load patches trained with this configuration into the module.

        Raises:
            InterventionLoadError: another kind, subspace size, node or shape (the reason is named).
            FingerprintMismatchError: saved for another model.
        """
        loaded = Intervention.load(directory, graph=self.graph, like=self.intervention)
        self.intervention.load_state_dict(loaded.state_dict())
