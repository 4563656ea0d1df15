"""The base of every recipe that trains patches on a frozen graph: specs → patches → an :class:`gradpatch.Intervention`.

:class:`PatchTrainingModule` loads the model (or takes one in memory, :meth:`~PatchTrainingModule.from_model`),
extracts its graph on a left-padded example and freezes it (:class:`~recipes.training.frozen.FrozenGraphModule`),
builds the patches its specs describe (:meth:`~PatchTrainingModule.build_patches`, one spec dataclass per
sibling: :attr:`~PatchTrainingModule.spec_type`), holds them in an :class:`~gradpatch.Intervention` whose parameters
are all the optimizer sees, and exports and loads them (safetensors + JSON with the model's fingerprint). Its
siblings add their own data, loss and metrics:

- :class:`recipes.delta.DeltaModule`: ``AddPatch`` deltas at fixed positions on the objective's prompts;
- :class:`recipes.interchange.InterventionModule`: interchange patches (DAS, Boundless DAS, masks) on counterfactual
  records, IIA;
- :class:`recipes.reft.ReFTModule`: LoReFT/DiReFT patches and steering vectors on continuations or preferences.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

from torch import nn

from gradpatch import Intervention
from gradpatch.patches import Patch

from ..errors import RecipeConfigError
from .frozen import DtypeName, FrozenGraphModule, OptimizerName, call_constants
from .specs import as_spec

__all__ = ["PatchTrainingModule"]


class PatchTrainingModule(FrozenGraphModule):
    """Train the patches of :attr:`specs` (an :class:`~gradpatch.Intervention`) on a frozen causal LM.

    A sibling names its spec dataclass (:attr:`spec_type`), builds each spec's patches (:meth:`build_patches`) and
    computes its loss (:meth:`~recipes.training.frozen.FrozenGraphModule.loss_terms`); it may check its data module's
    records before the first step (:meth:`check_records`).

    Args:
        interventions: the specs (instances of :attr:`spec_type` or mappings of its fields), in order.
        objective: what the sibling's :meth:`loss_terms` minimises (kept as :attr:`objective`).
        model_path: a ``save_pretrained`` directory or ``.gguf`` file; ``None`` for the embedded SmolLM2-135M-Instruct.
        lr: learning rate.
        optimizer: ``"adam"``, ``"adamw"`` or ``"sgd"``.
        dtype: dtype the model is loaded in (the patches stay float32).
        compile: run the frozen graph compiled (``pg.compile``: forward and backward through AOTAutograd, one
            compiled artefact per patch set, patch values as graph inputs; docs/engine.md, "Compiled graphs"):
            ``True`` for torch.compile's defaults (inductor), or a mapping of its keyword arguments
            (``{"backend": "aot_eager"}``, ``{"mode": "reduce-overhead"}``); ``False`` (default) runs it eagerly.
        _backbone: ``(model, tokenizer)`` already loaded (see :meth:`from_model`; not saved in hyperparameters).

    Raises:
        RecipeConfigError: no specs, a spec mapping with unknown keys.
        NodePathError: an unknown NodePath (from :meth:`build_patches`; the message lists the closest ones).
    """

    #: The dataclass of ``interventions`` (mappings are converted to it).
    spec_type: ClassVar[type]
    #: One spec as YAML writes it, named by the error for an empty ``interventions``.
    spec_example: ClassVar[str]

    def __init__(self, interventions: Sequence[Any], objective: Any, model_path: str | None = None,
                 lr: float = 1e-3, optimizer: OptimizerName = "adam", dtype: DtypeName = "float32",
                 compile: bool | dict[str, Any] = False, *, _backbone: tuple[nn.Module, Any] | None = None) -> None:
        super().__init__(lr=lr, optimizer=optimizer)
        self.specs = [as_spec(self.spec_type, spec) for spec in interventions]
        if not self.specs:
            raise RecipeConfigError(f"no interventions configured: add at least one {self.spec_example}")
        self.objective = objective
        model = self.load_backbone(model_path, dtype, _backbone)
        self.call_kwargs = self.graph_call_kwargs(model)
        pg = self.attach_left_padded_graph(model, **self.call_kwargs)
        if compile:
            pg.compile(**({} if compile is True else dict(compile)))
        self.built_patches: list[Patch] = []  # in the order of the specs
        patches: dict[str, list[Patch]] = {}
        for spec in self.specs:
            built = self.build_patches(pg, spec)
            patches.setdefault(spec.node, []).extend(built)
            self.built_patches.extend(built)
        self.intervention = Intervention(patches)  # tensor values become nn.Parameters, trainable patches submodules

    @classmethod
    def from_model(cls, model: nn.Module, tokenizer: Any, **config: Any) -> "PatchTrainingModule":
        """The module on a model already in memory (the other constructor arguments in ``config``)."""
        return cls(**config, _backbone=(model, tokenizer))

    def graph_call_kwargs(self, model: nn.Module) -> dict[str, Any]:
        """The constant keyword arguments of every graph call, fixed when the graph is extracted
        (:func:`~recipes.training.frozen.call_constants`: ``use_cache=False`` and, where the model takes it,
        ``logits_to_keep=1``, for objectives that score the last position only)."""
        return call_constants(model)

    def build_patches(self, pg: nn.Module, spec: Any) -> list[Patch]:
        """The patches of one spec at ``spec.node`` of ``pg`` (each sibling builds its own kinds).

        Raises:
            NodePathError: an unknown NodePath.
        """
        raise NotImplementedError(f"{type(self).__name__} must implement build_patches(pg, spec)")

    @property
    def patches(self) -> list[Patch]:
        """The patches, in the order of the specs."""
        return list(self.built_patches)

    @property
    def model(self) -> nn.Module:
        """The wrapped model (frozen)."""
        return self.__dict__["_model"]

    # --- data ----------------------------------------------------------------------------------------------

    def check_records(self, records: Sequence[Any]) -> None:
        """Check a data module's records before training (siblings with records encode them here; the base has
        none to check)."""

    def on_fit_start(self) -> None:
        """Check the data module's records (train and eval), if any, before the first step."""
        data = getattr(self.trainer, "datamodule", None)
        for name in ("train_records", "eval_records"):
            self.check_records(getattr(data, name, None) or [])

    # --- files ---------------------------------------------------------------------------------------------

    def export_intervention(self, directory: str | Path) -> Path:
        """Write the trained patches (``intervention.json`` + ``.safetensors``, with the model's fingerprint).

        Raises:
            NonFiniteError: a parameter holds NaN or inf (nothing is written).
        """
        return self.intervention.save(directory, model=self.model)

    def load_intervention(self, directory: str | Path) -> None:
        """Load patches trained with this configuration into the module.

        Raises:
            InterventionLoadError: another kind, size, node or shape (the reason is named).
            FingerprintMismatchError: saved for another model.
        """
        loaded = Intervention.load(directory, graph=self.graph, like=self.intervention)
        self.intervention.load_state_dict(loaded.state_dict())
