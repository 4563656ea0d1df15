"""ReFTModule: train LoReFT/DiReFT patches or steering vectors on a frozen causal LM with Lightning.

Example (what ``recipes/configs/loreft_capitals.yaml`` does)::

    from lightning.pytorch import Trainer
    from recipes import ContinuationDataModule, ReFTModule

    module = ReFTModule(interventions=[{"node": "model.layers_8.output", "kind": "loreft", "rank": 4,
                                        "positions": "f1+l1"}])
    data = ContinuationDataModule("train.jsonl", "eval.jsonl", batch_size=8)
    Trainer(max_steps=100).fit(module, datamodule=data)
    module.generate(["Q: capital of Peru?\\nA:"])   # KV-cache generation, ReFT at the prompt's positions
    module.export_intervention("runs/loreft")          # safetensors + JSON (rank, positions, part, model fingerprint)

Kinds (:class:`ReFTSpec`): ``loreft`` (:class:`~gradpatch.interventions.reft.LoReFTPatch`), ``direft``
(:class:`~gradpatch.interventions.DiReFTPatch`), ``add`` (:class:`~gradpatch.interventions.AddVectorPatch`, the
full-vector baseline at the same positions), each at the first/last prompt tokens, tied or untied across them; and
``steer`` (an ``AddPatch`` vector ``[d]`` at every token, what BiPO trains and CAA computes). The objective is pluggable
(:mod:`recipes.reft.objectives`, each a :class:`~recipes.reft.objectives.ReFTObjective` of the response tokens'
log-probabilities): continuation NLL with teacher forcing (default) or BiPO's preference loss. The module is a sibling
of :class:`~recipes.interchange.InterventionModule` and :class:`~recipes.delta.DeltaModule` on their base
:class:`~recipes.training.patches.PatchTrainingModule` (model loading, the frozen graph, the checks of the data
module's records before training, export and load); it adds its data (continuation and preference records), its
loss, its ``train/<term>`` logging, its validation and its metrics.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

import torch
from torch import nn

from gradpatch import AddPatch
from gradpatch.files.atomic import atomic_write_text
from gradpatch.interventions.interchange import check_interchange_node
from gradpatch.patches import Patch
from gradpatch.interventions.reft import (AddVectorPatch, DiReFTPatch, LoReFTPatch, ReFTPatch, ReFTPositions,
                                          check_saved_reft,
                            reft_patch_map)

from ..errors import RecipeConfigError
from ..generation import generate_with_patches, graph_logits
from ..tokens import encode, left_pad
from ..training.frozen import DtypeName, OptimizerName, term_scalars
from ..training.patches import PatchTrainingModule
from ..training.specs import as_spec, spec_dict
from .objectives import BiPOObjective, ContinuationNLLObjective, ReFTObjective

__all__ = ["ReFTKind", "ReFTModule", "ReFTSpec", "Tokenized", "build_reft_patches"]

ReFTKind = Literal["loreft", "direft", "add", "steer"]


@dataclass
class ReFTSpec:
    """One trained intervention.

    Attributes:
        node: NodePath of a ``[batch, seq, d]`` activation, e.g. ``"model.layers_8.output"`` (residual stream).
        kind: ``"loreft"``, ``"direft"``, ``"add"`` (a vector at the same positions) or ``"steer"`` (a vector at every
            token).
        rank: r of LoReFT/DiReFT (1 ≤ r < d).
        positions: ``"f<p>+l<s>"``: the first p and last s prompt tokens (pyreft's notation; not for ``steer``).
        tied: one patch for all positions (True) or one for the first and one for the last ones (False).
    """

    node: str
    kind: ReFTKind = "loreft"
    rank: int = 4
    positions: str = "f7+l7"
    tied: bool = True


@dataclass
class Tokenized:
    """Prompt + continuation token ids per row (prompt with special tokens, continuation without, then EOS)."""

    ids: list[list[int]]
    prompt_lengths: list[int]
    response_lengths: list[int]


def build_reft_patches(spec: ReFTSpec, width: int) -> list[Patch]:
    """The patches a spec describes, for a node of width ``width``.

    Raises:
        SubspaceConfigError: rank outside 1..d−1, bad positions.
        RecipeConfigError: an unknown kind.
    """
    if spec.kind == "steer":
        return [AddPatch(value=torch.zeros(width))]
    classes = {"loreft": LoReFTPatch, "direft": DiReFTPatch, "add": AddVectorPatch}
    if spec.kind not in classes:
        raise RecipeConfigError(f"intervention kind {spec.kind!r} is not one of 'loreft', 'direft', 'add', 'steer'")
    positions = ReFTPositions.parse(spec.positions)
    extra = {} if spec.kind == "add" else {"rank": spec.rank}
    return [classes[spec.kind](width, positions=str(positions), part=part, **extra)  # type: ignore[arg-type]
            for part in positions.parts(spec.tied)]


class ReFTModule(PatchTrainingModule):
    """Train ReFT patches or steering vectors at NodePaths of a frozen causal LM on continuation or preference data:
    the sibling of :class:`~recipes.interchange.InterventionModule` whose patches edit the representation itself.

    Its data are continuation or preference records: :meth:`encode`, :meth:`evaluate` and :meth:`write_metrics` take
    them.

    Args:
        interventions: :class:`ReFTSpec` (or mappings of its fields).
        objective: a :class:`~recipes.reft.objectives.ReFTObjective` (default: continuation NLL).
        model_path: a ``save_pretrained`` directory or ``.gguf`` file; ``None`` for the embedded SmolLM2-135M-Instruct.
        lr: learning rate.
        optimizer: ``"adam"``, ``"adamw"`` or ``"sgd"``.
        append_eos: end every continuation with the tokenizer's EOS token (as pyreft's training data).
        weight_decay: AdamW's decoupled weight decay (default 0, as pyreft's training runs), never applied to the
            orthogonal parametrization of LoReFT's R: torch's Householder map reads the signs of that tensor's diagonal
            with ``int()``, so a decayed diagonal (1 -> 0.999) would turn R into zeros.
        dtype: dtype the model is loaded in (the patches stay float32).
        compile: as :class:`~recipes.training.patches.PatchTrainingModule` (``True``, or torch.compile's keyword
            arguments: the frozen graph runs compiled).
        _backbone: ``(model, tokenizer)`` already loaded (see :meth:`from_model`).

    Raises:
        RecipeConfigError: no interventions, an unknown kind, a weight decay that is not a finite number >= 0, BiPO on
            a kind other than ``steer`` (only steering vectors take BiPO's signed direction).
        SubspaceConfigError: a node that is not ``[batch, seq, d]``, a rank ≥ d, bad positions.
        NodePathError: an unknown NodePath.
    """

    spec_type: ClassVar[type] = ReFTSpec
    spec_example: ClassVar[str] = "{node: ..., kind: loreft, rank: 4}"

    def __init__(self, interventions: list[ReFTSpec], objective: ReFTObjective | None = None,
                 model_path: str | None = None, lr: float = 4e-3, optimizer: OptimizerName = "adamw",
                 append_eos: bool = True, weight_decay: float = 0.0, dtype: DtypeName = "float32",
                 compile: bool | dict[str, Any] = False, *, _backbone: tuple[nn.Module, Any] | None = None) -> None:
        if not (isinstance(weight_decay, (int, float)) and 0.0 <= weight_decay < float("inf")):
            raise RecipeConfigError(f"weight_decay must be a finite number >= 0, got {weight_decay!r}")
        unsigned = sorted({as_spec(ReFTSpec, spec).kind for spec in interventions} - {"steer"})
        if isinstance(objective, BiPOObjective) and unsigned:
            raise RecipeConfigError(f"BiPO trains steering vectors (kind 'steer', whose sign it flips at random each "
                                    f"step); kinds {unsigned} take no sign: use kind steer, or the continuation "
                                    f"objective for them")
        super().__init__(interventions=interventions,
                         objective=objective if objective is not None else ContinuationNLLObjective(),
                         model_path=model_path, lr=lr, optimizer=optimizer, dtype=dtype, compile=compile,
                         _backbone=_backbone)
        self.append_eos = append_eos
        self.weight_decay = float(weight_decay)
        self.save_hyperparameters(ignore=["_backbone", "objective"], logger=False)  # checkpoints give them back
        self.hparams["interventions"] = spec_dict(self.specs)

    def graph_call_kwargs(self, model: nn.Module) -> dict[str, Any]:
        """``use_cache=False`` only: the continuation objectives score every response token (all logits)."""
        return {"use_cache": False}

    def build_patches(self, pg: nn.Module, spec: Any) -> list[Patch]:
        """:func:`build_reft_patches` of a :class:`ReFTSpec` at ``spec.node`` of ``pg``.

        Raises:
            SubspaceConfigError: a node that is not ``[batch, seq, d]``, a rank ≥ d, bad positions.
            RecipeConfigError: an unknown kind.
            NodePathError: an unknown NodePath.
        """
        return build_reft_patches(spec, check_interchange_node(pg, spec.node))

    def parameter_count(self) -> int:
        """Number of trained parameters (LoReFT: 2·r·d + r per patch; a vector: d)."""
        return sum(p.numel() for p in self.trainable_parameters())

    # --- data ----------------------------------------------------------------------------------------------

    def encode(self, prompts: Sequence[str], responses: Sequence[str]) -> Tokenized:
        """Tokenize prompt/continuation pairs and check every ReFT patch's positions fit each prompt.

        Raises:
            RecipeConfigError: an empty prompt or continuation.
            SubspaceConfigError: a prompt shorter than a patch's positions.
        """
        ids, prompt_lengths, response_lengths = [], [], []
        eos = [self.tokenizer.eos_token_id] if self.append_eos and self.tokenizer.eos_token_id is not None else []
        for prompt, response in zip(prompts, responses):
            if not response.strip():
                raise RecipeConfigError(f"prompt {prompt!r} has an empty response; give a non-empty continuation")
            head, tail = encode(self.tokenizer, prompt), encode(self.tokenizer, response, add_special_tokens=False)
            ids.append(head + tail + eos)
            prompt_lengths.append(len(head))
            response_lengths.append(len(tail) + len(eos))
        tokenized = Tokenized(ids, prompt_lengths, response_lengths)
        self.patch_map(tokenized)  # positions past a prompt raise here
        return tokenized

    def check_records(self, records: Sequence[Any]) -> None:
        """Encode every record (continuation or preference) so that bad input fails before training
        (:meth:`~recipes.training.patches.PatchTrainingModule.on_fit_start` calls it on the train and eval records).

        Raises:
            RecipeConfigError, SubspaceConfigError: as :meth:`encode`.
        """
        for record in records:
            for response in _responses(record):
                self.encode([record.prompt], [response])

    # --- forward passes ------------------------------------------------------------------------------------

    def patch_map(self, tokenized: Tokenized, sign: float = 1.0) -> dict[str, list[Patch]]:
        """The ``pg.patch`` mapping for a left-padded batch of ``tokenized``: ReFT patches at each prompt's positions,
        steering vectors (times ``sign``) at every token.

        Raises:
            SubspaceConfigError: a prompt shorter than a patch's positions.
        """
        width = max(len(row) for row in tokenized.ids)
        offsets = [width - len(row) for row in tokenized.ids]
        mapping: dict[str, list[Patch]] = {}
        for path, items in self.intervention.patch_map().items():
            reft = [p for p in items if isinstance(p, ReFTPatch)]
            if reft:
                mapping.setdefault(path, []).extend(reft_patch_map({path: reft}, tokenized.prompt_lengths,
                                                                   offsets)[path])
            for patch in items:
                if isinstance(patch, AddPatch):
                    mapping.setdefault(path, []).append(AddPatch(value=patch.value * sign))
        return mapping

    def token_log_probs(self, tokenized: Tokenized, sign: float | None = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        """Teacher-forced log-probabilities of each continuation token.

        Args:
            tokenized: ``B`` rows.
            sign: multiplies steering vectors (BiPO's direction); ``None`` runs the model without any intervention.

        Returns:
            ``(log_probs [B, T], mask [B, T])`` float32, ``T`` the longest continuation; the continuation of row ``i``
            fills its last ``response_lengths[i]`` columns (mask 1 there, 0 elsewhere).
        """
        batch = left_pad(tokenized.ids, self.pad_id)
        width, longest = batch["input_ids"].shape[1], max(tokenized.response_lengths)
        mapping = {} if sign is None else self.patch_map(tokenized, sign)
        with self.graph.patch(mapping):
            logits = graph_logits(self.graph, batch, self.call_kwargs)
        device = logits.device
        log_probs = torch.log_softmax(logits[:, width - longest - 1:width - 1].float(), dim=-1)
        targets = batch["input_ids"][:, width - longest:].to(device)
        picked = log_probs.gather(-1, targets[..., None])[..., 0]
        column = torch.arange(longest, device=device)[None, :]
        mask = (column >= longest - torch.tensor(tokenized.response_lengths, device=device)[:, None]).float()
        return picked * mask, mask

    def generate(self, prompts: Sequence[str], max_new_tokens: int = 32, batch_size: int = 8) -> list[str]:
        """Greedy KV-cache continuations with the trained intervention (:func:`generate_with_patches`)."""
        return generate_with_patches(self.graph, self.tokenizer, self.intervention.patch_map(), prompts,
                                     max_new_tokens, batch_size)

    # --- training ------------------------------------------------------------------------------------------

    def loss_terms(self, batch: Sequence[Any]) -> dict[str, torch.Tensor]:
        """The objective's terms on a batch of records: for continuation records the teacher-forced log-probabilities
        of the responses with the intervention (:meth:`ReFTObjective.continuation_terms
        <recipes.reft.objectives.ReFTObjective.continuation_terms>`); for preference records those of the chosen and
        rejected responses summed per row, without the intervention and with it (steering vectors times the
        objective's :meth:`~recipes.reft.objectives.ReFTObjective.direction`;
        :meth:`~recipes.reft.objectives.ReFTObjective.preference_terms`).

        Raises:
            RecipeConfigError: records the objective does not score.
        """
        prompts = [record.prompt for record in batch]
        if hasattr(batch[0], "response"):
            log_probs, mask = self.token_log_probs(self.encode(prompts, [record.response for record in batch]))
            return self.objective.continuation_terms(log_probs, mask)
        chosen = self.encode(prompts, [record.chosen for record in batch])
        rejected = self.encode(prompts, [record.rejected for record in batch])
        direction = self.objective.direction(self.training)
        with torch.no_grad():
            reference = tuple(self.token_log_probs(side, sign=None)[0].sum(-1) for side in (chosen, rejected))
        steered = tuple(self.token_log_probs(side, sign=direction)[0].sum(-1) for side in (chosen, rejected))
        return self.objective.preference_terms(steered, reference, direction)  # type: ignore[arg-type]

    def step_logs(self, terms: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """What each step logs to the trainer's logger: ``train/<term>``."""
        return term_scalars(terms, "train/")

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        """The objective's terms on the eval batch, logged as ``val_<term>`` (averaged over the eval file)."""
        with torch.no_grad():
            terms = self.loss_terms(batch)
        self.log_dict({f"val_{name}": value for name, value in terms.items() if value.numel() == 1},
                      on_step=False, on_epoch=True, batch_size=len(batch))

    def load_intervention(self, directory: str | Path) -> None:
        """Load an intervention trained with this configuration into the module.

        Raises:
            InterventionLoadError: another kind, rank, positions, tying or node (the difference is named).
            FingerprintMismatchError: saved for another model.
        """
        check_saved_reft(directory, self.intervention.patch_map())
        super().load_intervention(directory)

    @torch.no_grad()
    def evaluate(self, records: Sequence[Any], batch_size: int = 16) -> dict[str, Any]:
        """Held-out scores of the intervention beside the frozen model without it (the exact comparison).

        Continuation records: ``nll`` and ``base_nll`` (mean NLL per response token with and without the
        intervention). Preference records: ``logratio_margin`` (mean over records of
        [log π_v(chosen) − log π(chosen)] − [log π_v(rejected) − log π(rejected)], steering with d = +1) and
        ``preference_accuracy`` (fraction of records where that margin is > 0).

        Returns:
            The scores and ``examples``.
        """
        sums: dict[str, float] = {}
        tokens = 0.0
        for start in range(0, len(records), batch_size):
            chunk = records[start:start + batch_size]
            prompts = [r.prompt for r in chunk]
            if hasattr(chunk[0], "response"):
                tokenized = self.encode(prompts, [r.response for r in chunk])
                patched, mask = self.token_log_probs(tokenized)
                sums["nll"] = sums.get("nll", 0.0) - float(patched.sum())
                sums["base_nll"] = sums.get("base_nll", 0.0) - float(self.token_log_probs(tokenized, None)[0].sum())
                tokens += float(mask.sum())
                continue
            gains = []
            for responses in ([r.chosen for r in chunk], [r.rejected for r in chunk]):
                tokenized = self.encode(prompts, responses)
                steered, plain = self.token_log_probs(tokenized)[0], self.token_log_probs(tokenized, None)[0]
                gains.append(steered.sum(-1) - plain.sum(-1))
            margin = gains[0] - gains[1]
            sums["logratio_margin"] = sums.get("logratio_margin", 0.0) + float(margin.sum())
            sums["preference_accuracy"] = sums.get("preference_accuracy", 0.0) + float((margin > 0).sum())
        scale = tokens if tokens else max(1, len(records))
        return {**{name: value / scale for name, value in sums.items()}, "examples": len(records)}

    def write_metrics(self, directory: str | Path, records: Sequence[Any]) -> dict[str, Any]:
        """Write ``metrics.json`` atomically: :meth:`evaluate` on ``records`` plus the configuration (nodes, kinds,
        parameter count, steps).

        Returns:
            What was written.
        """
        document = {**self.evaluate(records), "parameters": self.parameter_count(), "steps": int(self.global_step),
                    "lr": self.lr, "interventions": spec_dict(self.specs)}
        atomic_write_text(Path(directory) / "metrics.json", json.dumps(document, indent=2))
        return document


def _responses(record: Any) -> list[str]:
    """The continuations of a record: ``response``, or ``chosen`` and ``rejected``."""
    if hasattr(record, "response"):
        return [record.response]
    return [record.chosen, record.rejected]
