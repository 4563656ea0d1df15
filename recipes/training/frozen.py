"""A LightningModule that optimises a few tensors against a frozen PatchableGraph.

:class:`FrozenGraphModule` is the base of :class:`~recipes.training.patches.PatchTrainingModule` (and so of
:class:`~recipes.delta.DeltaModule`, :class:`~recipes.interchange.InterventionModule` and
:class:`~recipes.reft.ReFTModule`) and of :class:`~recipes.training.objective_module.ObjectiveModule`. It holds
the graph with every model weight frozen (no gradients, no optimizer state, no checkpoint entry) and keeps it in
``eval()`` whatever Lightning does with the training flag; subclasses register the trainable tensors and implement
:meth:`FrozenGraphModule.loss_terms`. Training stops at the first non-finite loss term, gradient or updated tensor
with a :class:`gradpatch.errors.NonFiniteError` naming the step (see :meth:`FrozenGraphModule.step_guard`).
"""

from __future__ import annotations

import inspect
import math
import warnings
from typing import Any, Literal

import torch
from lightning.pytorch import LightningModule
from torch import nn

from gradpatch import PatchableGraph
from gradpatch.errors import NonFiniteError
from gradpatch.finite import StepGuard, non_finite_names
from gradpatch.model_io import model_device

from ..errors import RecipeConfigError
from ..tokens import left_pad, pad_token_id

#: ``model_label`` of the embedded model (``model_path`` None).
EMBEDDED_MODEL_LABEL = "embedded SmolLM2-135M-Instruct"

__all__ = ["DtypeName", "EMBEDDED_MODEL_LABEL", "FrozenGraphModule", "OptimizerName", "GRAPH_ATTRIBUTE",
           "call_constants", "term_scalars"]

OptimizerName = Literal["adam", "adamw", "sgd"]
DtypeName = Literal["float32", "bfloat16", "float16"]

#: Attribute (and ``state_dict`` prefix) under which the frozen graph is registered.
GRAPH_ATTRIBUTE = "pg"

# Lightning warns when modules are in eval mode at the start of fit; the frozen model is, on purpose.
_EVAL_MODE_WARNING = r"Found \d+ module\(s\) in eval mode at the start of training"


class FrozenGraphModule(LightningModule):
    """Base class: a frozen PatchableGraph (``self.pg``) plus trainable tensors.

    - The graph's parameters get ``requires_grad=False``; :meth:`configure_optimizers` sees only
      :meth:`trainable_parameters` (every parameter not under ``pg.``).
    - ``train()`` never switches the graph out of ``eval()`` (no dropout; no extraction of training-mode graphs).
    - Checkpoints keep only the trainable tensors (:meth:`on_save_checkpoint`); ``strict_loading = False`` lets a
      module with a freshly loaded model take them back, and :meth:`on_load_checkpoint` checks that none is missing.
    - Under DDP the frozen weights and buffers are neither broadcast nor synchronised
      (``_ddp_params_and_buffers_to_ignore``); only the trainable tensors' gradients are all-reduced.
    - Each step's loss terms, the trainable tensors' gradients and the tensors after the optimizer update are checked:
      the first NaN or inf raises :class:`gradpatch.errors.NonFiniteError` naming the step (``global_step``, from 0)
      and the terms or tensors, as does an update that overflows (a learning rate such as 1e38). With several ranks
      the loss terms' check is agreed before the backward pass, so a NaN on one rank stops every rank.

    Args:
        lr: learning rate (finite, > 0).
        optimizer: ``"adam"``, ``"adamw"`` or ``"sgd"``.

    Raises:
        RecipeConfigError: an unknown optimizer, or a learning rate that is not a finite positive number.
    """

    strict_loading = False

    def __init__(self, lr: float = 0.05, optimizer: OptimizerName = "adam") -> None:
        super().__init__()
        if optimizer not in ("adam", "adamw", "sgd"):
            raise RecipeConfigError(f"optimizer {optimizer!r} is not one of 'adam', 'adamw', 'sgd'")
        if not (isinstance(lr, (int, float)) and math.isfinite(lr) and lr > 0):
            raise RecipeConfigError(f"lr must be a finite positive number, got {lr!r}; e.g. 0.05")
        self.lr = float(lr)
        self.optimizer_name = optimizer
        #: AdamW's decoupled weight decay (torch's default; a subclass may set its own).
        self.weight_decay = 0.01
        self._step_terms: dict[str, float] = {}

    # --- the frozen graph ----------------------------------------------------------------------------------

    def attach_graph(self, pg: nn.Module) -> None:
        """Register ``pg`` as the frozen graph: weights frozen, ``eval()`` mode, ignored by DDP.

        Args:
            pg: a :class:`gradpatch.PatchableGraph`.
        """
        pg.requires_grad_(False)
        pg.train(False)
        setattr(self, GRAPH_ATTRIBUTE, pg)
        prefix = GRAPH_ATTRIBUTE + "."
        self._ddp_params_and_buffers_to_ignore = [prefix + name for name, _ in pg.named_parameters()] + [
            prefix + name for name, _ in pg.named_buffers()]

    @property
    def graph(self) -> nn.Module:
        """The frozen PatchableGraph.

        Raises:
            RuntimeError: :meth:`attach_graph` was not called (a subclass bug).
        """
        pg = self._modules.get(GRAPH_ATTRIBUTE)
        if pg is None:
            raise RuntimeError(f"{type(self).__name__} has no graph; call self.attach_graph(pg) in __init__")
        return pg

    def load_backbone(self, model_path: str | None, dtype: str,
                      backbone: tuple[nn.Module, Any] | None) -> nn.Module:
        """The frozen model: loaded from ``model_path`` (a directory or .gguf file; the embedded SmolLM2 when
        ``None``) in the torch dtype named ``dtype``, or the in-memory ``(model, tokenizer)`` ``backbone``. Sets
        ``tokenizer``, ``model_label`` and ``pad_id``; the model is kept unregistered (its weights live in the graph
        given to :meth:`attach_graph`)."""
        if backbone is None:
            from gradpatch.files.loaders import load_model

            model, tokenizer = load_model(model_path, dtype=getattr(torch, dtype))
            self.model_label = model_path or EMBEDDED_MODEL_LABEL
        else:
            model, tokenizer = backbone
            self.model_label = f"{type(model).__name__} (in memory)"
        self.tokenizer = tokenizer
        self.__dict__["_model"] = model
        self.pad_id = pad_token_id(tokenizer)
        return model

    def attach_left_padded_graph(self, model: nn.Module, **call_kwargs: Any) -> PatchableGraph:
        """Extract ``model``'s graph on a left-padded example batch (so the graphs serve padded batches) and attach
        it (:meth:`attach_graph`); ``call_kwargs`` are the forward's constant arguments (``use_cache=False``)."""
        token = next(i for i in range(len(self.tokenizer)) if i != self.pad_id)
        device = model_device(model)
        example = {name: t.to(device) for name, t in left_pad([[token] * 3, [token] * 4], self.pad_id).items()}
        with torch.no_grad():
            pg = PatchableGraph(model, example["input_ids"], attention_mask=example["attention_mask"],
                                position_ids=example["position_ids"], **call_kwargs)
        self.attach_graph(pg)
        return pg

    def trainable_parameters(self) -> list[nn.Parameter]:
        """The parameters the optimizer updates: all but the frozen graph's."""
        return [p for name, p in self.named_parameters() if not name.startswith(GRAPH_ATTRIBUTE + ".")]

    def train(self, mode: bool = True) -> "FrozenGraphModule":
        """Set training mode on this module and its children, except the frozen graph, which stays in ``eval()``."""
        self.training = mode
        graph = self._modules.get(GRAPH_ATTRIBUTE)
        for child in self.children():
            if child is not graph:
                child.train(mode)
        return self

    # --- optimisation --------------------------------------------------------------------------------------

    def loss_terms(self, batch: Any) -> dict[str, torch.Tensor]:
        """The objective on one batch.

        Returns:
            ``{"loss": scalar to minimise, ...}``; other entries (scalars) are logged as they are, detached.
        """
        raise NotImplementedError(f"{type(self).__name__} must implement loss_terms(batch) -> {{'loss': ...}}")

    def step_guard(self) -> StepGuard:
        """How a non-finite step is reported: this module's name and the fix (subclasses name their own)."""
        return StepGuard(type(self).__name__, f"lower the learning rate (lr={self.lr:g}); nothing was exported")

    def named_trainable(self) -> dict[str, nn.Parameter]:
        """``state_dict`` name -> trainable tensor (what the finiteness checks name)."""
        prefix = GRAPH_ATTRIBUTE + "."
        return {name: p for name, p in self.named_parameters() if not name.startswith(prefix)}

    def step_logs(self, terms: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """What each step logs to the trainer's logger beside the loss on the progress bar: nothing here; a module
        that logs its terms or statistics returns them (scalars, e.g. :func:`term_scalars`)."""
        return {}

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        """One step: :meth:`loss_terms` (checked to be finite), the loss on the progress bar, :meth:`step_logs` to
        the logger.

        Returns:
            ``{"loss": loss, "terms": {name: detached scalar}}`` (``terms`` reaches callbacks'
            ``on_train_batch_end`` as ``outputs["terms"]``).

        Raises:
            NonFiniteError: a loss term is NaN or inf (the message names the step and the terms).
        """
        terms = self.loss_terms(batch)
        self.check_terms_on_every_rank(terms)
        self._step_terms = {name: float(value.detach()) for name, value in terms.items() if value.numel() == 1}
        loss = terms["loss"]
        size = _batch_size(batch)
        self.log("loss", loss.detach(), prog_bar=True, logger=False, on_step=True, on_epoch=False, batch_size=size)
        detached = {name: value.detach() for name, value in terms.items()}
        logged = self.step_logs(detached)
        if logged:
            self.log_dict(logged, on_step=True, on_epoch=False, batch_size=size)
        return {"loss": loss, "terms": detached}

    def check_terms_on_every_rank(self, terms: dict[str, torch.Tensor]) -> None:
        """Stop every rank when a loss term is non-finite on any one, before the backward pass all-reduces gradients
        (so no rank is left waiting in it): one all-reduce of ``world_size`` flags per step when there are several
        ranks.

        Raises:
            NonFiniteError: on the rank with the non-finite term, naming the terms; on the others, naming that rank.
        """
        guard = self.step_guard()
        if self.trainer.world_size > 1:
            finite = not non_finite_names(terms)
            flags = torch.zeros(self.trainer.world_size, device=self.device)
            flags[self.trainer.global_rank] = float(not finite)
            flags = self.trainer.strategy.reduce(flags, reduce_op="sum")
            bad = [rank for rank, flag in enumerate(flags.tolist()) if flag]
            if bad and finite:
                raise NonFiniteError(f"{guard.where}: a loss term is non-finite at step {self.global_step} on rank(s) "
                                     f"{bad}; every rank stops; {guard.fix}")
        guard.check_terms(self.global_step, terms)

    def on_after_backward(self) -> None:
        """Stop at a non-finite gradient of a trainable tensor.

        Raises:
            NonFiniteError: naming the step, the tensors and the step's loss terms.
        """
        self.step_guard().check_gradients(self.global_step, self.named_trainable(), self._step_terms)

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
        """Lightning's optimizer step, then a check that the update left every trainable tensor finite.

        Raises:
            NonFiniteError: the update overflowed (torch's "value cannot be converted ... without overflow") or made a
                tensor NaN or inf; the message names the step and the learning rate.
        """
        guard = self.step_guard()
        with guard.update(self.global_step, self.lr):
            super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)
        guard.check_values(self.global_step, self.named_trainable())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        """An optimizer over :meth:`trainable_parameters` only. AdamW decays every trainable tensor by
        :attr:`weight_decay` except those behind a ``torch.nn.utils.parametrize`` parametrization (an orthogonal
        ``R``): decay would pull them off their manifold (torch's orthogonal parametrization of a non-square ``R``
        collapses to zeros within a step).

        Raises:
            RecipeConfigError: there is nothing to train.
        """
        named = self.named_trainable()
        if not named:
            raise RecipeConfigError(f"{type(self).__name__} has no trainable tensors; configure at least one delta")
        if self.optimizer_name == "adam":
            return torch.optim.Adam(list(named.values()), lr=self.lr)
        if self.optimizer_name == "adamw":
            parametrized = [p for name, p in named.items() if ".parametrizations." in name]
            others = [p for name, p in named.items() if ".parametrizations." not in name]
            groups = [{"params": group, "weight_decay": decay}
                      for group, decay in ((others, self.weight_decay), (parametrized, 0.0)) if group]
            return torch.optim.AdamW(groups, lr=self.lr)
        return torch.optim.SGD(list(named.values()), lr=self.lr)

    def setup(self, stage: str) -> None:
        """Silence Lightning's warning about modules in eval mode: the frozen model is in eval mode on purpose."""
        warnings.filterwarnings("ignore", message=_EVAL_MODE_WARNING)

    # --- checkpoints ---------------------------------------------------------------------------------------

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """The ``state_dict`` entries of the trainable tensors (what checkpoints hold)."""
        return _without_graph(self.state_dict())

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Drop the frozen model's weights from the checkpoint: it keeps the trainable tensors only (kilobytes)."""
        checkpoint["state_dict"] = _without_graph(checkpoint["state_dict"])

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Check that the checkpoint holds every trainable tensor (loading is not strict, because the frozen model
        is not in it).

        Raises:
            RecipeConfigError: trainable tensors missing from the checkpoint (it was saved with other deltas).
        """
        missing = sorted(set(self.trainable_state_dict()) - set(checkpoint.get("state_dict", {})))
        if missing:
            raise RecipeConfigError(f"checkpoint lacks trainable tensors {missing}: load it with the configuration "
                                    f"it was trained with (its hyper_parameters)")


def call_constants(model: nn.Module) -> dict[str, Any]:
    """Constant keyword arguments of every graph call: ``use_cache=False``, and ``logits_to_keep=1`` (only the last
    position's logits: the recipes score nothing else) when the model's ``forward`` takes it."""
    constants: dict[str, Any] = {"use_cache": False}
    if "logits_to_keep" in inspect.signature(model.forward).parameters:
        constants["logits_to_keep"] = 1
    return constants


def _without_graph(state: dict[str, Any]) -> dict[str, Any]:
    prefix = GRAPH_ATTRIBUTE + "."
    return {key: value for key, value in state.items() if not key.startswith(prefix)}


def term_scalars(terms: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """The one-element entries of ``terms`` under ``prefix`` + their name (``train/ce``), for the logger."""
    return {f"{prefix}{name}": value for name, value in terms.items() if value.numel() == 1}


def _batch_size(batch: Any) -> int:
    if isinstance(batch, (list, tuple)):
        return len(batch)
    if isinstance(batch, dict):
        for value in batch.values():
            if isinstance(value, torch.Tensor) and value.ndim:
                return int(value.shape[0])
    return 1

