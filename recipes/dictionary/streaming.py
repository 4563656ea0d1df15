"""The base of the local dictionary trainings: activations streamed from a frozen PatchableGraph through a shuffle
buffer, with the settings that matter at small budgets.

:class:`StreamingModule` reads every node its dictionaries need in one forward pass of the frozen graph that stops
after the deepest one (:func:`gradpatch.capture.node_activations`), pushes the rows (the first
``exclude_first_positions`` of each sequence left out) into an :class:`~recipes.dictionary.buffer.ActivationBuffer`
and, once it is full, trains on as many rows drawn at random (more in the run's last batches, so that it ends empty:
:meth:`StreamingModule.rows_to_draw`); before the first optimizer step it sets the decoder
biases from those rows (``b_dec_init``); each optimizer step runs at the scheduled learning rate
(:func:`~recipes.dictionary.settings.lr_factor`). Subclasses: :class:`~recipes.dictionary.DictionaryModule`
(SAEs and transcoders, one per node), :class:`~recipes.dictionary.CrossLayerTranscoderModule`.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any, Literal

import torch

from gradpatch.capture import node_activations
from gradpatch.finite import StepGuard

from ..errors import RecipeConfigError
from ..training.frozen import FrozenGraphModule, OptimizerName
from .buffer import ActivationBuffer
from .settings import geometric_median, lr_factor, warmup_factor

__all__ = ["BDecInit", "StreamingModule"]

#: How training sets the decoder bias before its first step: the ``"mean"`` or ``"geometric_median"`` of the first
#: step's targets, or ``"keep"``.
BDecInit = Literal["mean", "geometric_median", "keep"]
#: Lightning's warning when ``training_step`` returns ``None``: the steps that fill the buffer do, on purpose.
_NO_STEP_WARNING = r"`training_step` returned `None`"


class StreamingModule(FrozenGraphModule):
    """Dictionaries trained on the streamed activations of ``pg``'s ``nodes`` (module docstring).

    Args:
        pg: the frozen :class:`gradpatch.PatchableGraph`.
        nodes: every NodePath read, in order; a batch's rows are their activations side by side.
        exclude_first_positions: the first positions of every sequence left out.
        buffer_rows, lr, optimizer, seed, b_dec_init, lr_warmup_steps, lr_decay_fraction, sparsity_warmup_steps:
            as :class:`~recipes.dictionary.DictionaryModule`.

    Raises:
        RecipeConfigError: a non-positive ``buffer_rows``, an unknown ``b_dec_init``, a negative warm-up or a decay
            fraction outside [0, 1].
    """

    def __init__(self, pg: Any, nodes: list[str], exclude_first_positions: int, buffer_rows: int, lr: float,
                 optimizer: OptimizerName, seed: int, b_dec_init: BDecInit, lr_warmup_steps: int,
                 lr_decay_fraction: float, sparsity_warmup_steps: int) -> None:
        super().__init__(lr=lr, optimizer=optimizer)
        if b_dec_init not in ("mean", "geometric_median", "keep"):
            raise RecipeConfigError(f"b_dec_init must be 'mean', 'geometric_median' or 'keep', got {b_dec_init!r}")
        if min(lr_warmup_steps, sparsity_warmup_steps) < 0 or not 0.0 <= lr_decay_fraction <= 1.0:
            raise RecipeConfigError(f"lr_warmup_steps ({lr_warmup_steps}) and sparsity_warmup_steps "
                                    f"({sparsity_warmup_steps}) must be >= 0, lr_decay_fraction "
                                    f"({lr_decay_fraction}) in [0, 1]")
        if buffer_rows < 1:
            raise RecipeConfigError(f"buffer_rows ({buffer_rows}) must be positive")
        self.attach_graph(pg)
        #: Every node read, in order; a dictionary's input and target are columns of their concatenation.
        self.nodes: list[str] = list(nodes)
        #: The first positions of every sequence left out (the dictionaries' ``exclude_first_positions``).
        self.exclude_first_positions: int = int(exclude_first_positions)
        self.buffer = ActivationBuffer(buffer_rows, torch.Generator().manual_seed(seed))
        #: Whether the first optimizer step still sets the decoder biases (``b_dec_init`` not ``"keep"``; in
        #: checkpoints).
        self.register_buffer("b_dec_pending", torch.tensor(b_dec_init != "keep"))
        self.b_dec_init: BDecInit = b_dec_init
        self.lr_warmup_steps, self.lr_decay_fraction = int(lr_warmup_steps), float(lr_decay_fraction)
        self.sparsity_warmup_steps = int(sparsity_warmup_steps)
        #: Training batches that only filled the buffer, before the first optimizer step (in checkpoints).
        self.register_buffer("fill_batches", torch.zeros((), dtype=torch.long))
        self.saved_to: Path | None = None

    # --- what subclasses implement -------------------------------------------------------------------------

    def initialize_from_rows(self, rows: torch.Tensor) -> None:
        """Set the decoder biases from the first drawn ``rows`` ``[n, Σ widths]`` (with :meth:`data_center`)."""
        raise NotImplementedError

    def save_dictionaries(self, folder: Path) -> None:
        """Write the trained dictionaries to ``folder``."""
        raise NotImplementedError

    # --- streaming -----------------------------------------------------------------------------------------

    def step_guard(self) -> StepGuard:
        """How a non-finite step is reported (a :class:`gradpatch.errors.NonFiniteError`; nothing is written)."""
        return StepGuard(type(self).__name__, f"lower the learning rate (lr={self.lr:g}) or check the dictionary's "
                                              f"starting weights; no dictionary was written")

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any] | None:
        """Stream one batch of token ids into the buffer; train on as many buffered rows once it is full (``None``,
        no optimizer step, while it fills)."""
        ids = batch["input_ids"] if isinstance(batch, dict) else batch
        first = self.exclude_first_positions
        activations = node_activations(self.graph, self.nodes, ids)
        rows = torch.cat([a[:, first:].reshape(-1, a.shape[-1]).float() for a in activations], dim=-1)
        self.buffer.push(rows)
        # Lightning counts the batches that only filled the buffer as steps: global_step > fill_batches once a
        # step has trained; from then on the buffer is not refilled (rows_to_draw empties it by the run's end).
        if self.global_step <= int(self.fill_batches) and not self.buffer.ready(rows.shape[0]):
            self.fill_batches += 1
            return None
        drawn = self.buffer.pop(self.rows_to_draw(rows.shape[0], batch_idx))
        if bool(self.b_dec_pending):
            with torch.no_grad():
                self.initialize_from_rows(drawn)
            self.b_dec_pending.fill_(False)
        return super().training_step(drawn, batch_idx)

    def rows_to_draw(self, pushed: int, batch_idx: int) -> int:
        """The rows this step trains on: as many as were ``pushed``, more in the run's last batches so that the
        buffer is empty after the last one (each of the ``r`` batches left draws at least ``1 / r`` of the rows
        held), so every row streamed is trained on once. The run's end is ``max_steps`` or the last epoch's last
        batch, whichever Lightning reaches first; a run that ``max_time`` stops earlier leaves the rows it held."""
        trainer = self.trainer
        left = []
        if trainer.max_steps > 0:
            left.append(trainer.max_steps - self.global_step)
        batches = trainer.num_training_batches
        if trainer.max_epochs is not None and trainer.current_epoch == trainer.max_epochs - 1 and math.isfinite(
                batches):
            left.append(int(batches) - batch_idx)
        if not left or min(left) < 1:
            return pushed
        return min(len(self.buffer), max(pushed, math.ceil(len(self.buffer) / min(left))))

    def data_center(self, rows: torch.Tensor) -> torch.Tensor:
        """The ``b_dec_init`` statistic of ``rows`` ``[n, d]`` (mean or geometric median, float64), averaged over
        the DDP ranks: ``[d]``."""
        rows = rows.double()
        center = geometric_median(rows) if self.b_dec_init == "geometric_median" else rows.mean(0)
        return self.trainer.strategy.reduce(center, reduce_op="mean")

    # --- schedules -----------------------------------------------------------------------------------------

    def run_steps(self) -> int:
        """The optimizer steps this run takes, as far as Lightning knows: ``max_steps`` when it ends the run, else
        the epochs' batches less those that only filled the buffer (≥ 1)."""
        trainer = self.trainer
        estimated = trainer.estimated_stepping_batches
        if trainer.max_steps > 0 and estimated == trainer.max_steps:
            return int(trainer.max_steps)
        if not math.isfinite(estimated):
            return 1 << 62
        return max(int(estimated) - int(self.fill_batches), 1)

    def sparsity_scale(self) -> float:
        """λ's warm-up factor at this optimizer step (:func:`~recipes.dictionary.settings.warmup_factor`)."""
        return warmup_factor(self.global_step, self.sparsity_warmup_steps)

    def log_terms(self, terms: dict[str, torch.Tensor]) -> None:
        """Log every term but ``loss`` (detached), on this step."""
        self.log_dict({name: value.detach() for name, value in terms.items() if name != "loss"}, on_step=True,
                      on_epoch=False, batch_size=1)

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
        """The learning rate of this step (``lr_warmup_steps``, ``lr_decay_fraction``), then the checked optimizer
        step.

        The step runs Lightning's closure (``training_step``), which warns when the step returns ``None``: the steps
        that fill the buffer do so on purpose, so that warning (and only it) is hidden here, for this call only.
        (With ``accumulate_grad_batches`` > 1 Lightning runs the closure of the batches it accumulates outside this
        method, and warns once.)"""
        if self.lr_warmup_steps or self.lr_decay_fraction:
            factor = lr_factor(self.global_step, self.run_steps(), self.lr_warmup_steps, self.lr_decay_fraction)
            for group in optimizer.param_groups:
                group["lr"] = self.lr * factor
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_NO_STEP_WARNING, category=UserWarning)
            super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)

    # --- checkpoints and files -----------------------------------------------------------------------------

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """The trainable tensors, the firing counters, and the activation buffer's rows and generator (so a run
        resumed from the checkpoint draws what the uninterrupted run would)."""
        super().on_save_checkpoint(checkpoint)
        generator = self.buffer.generator
        rows = self.buffer.rows
        checkpoint["activation_buffer"] = {"rows": None if rows is None else rows.clone(),  # not the whole storage
                                           "generator": None if generator is None else generator.get_state()}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Check the trainable tensors (as the base class does), then restore the activation buffer."""
        super().on_load_checkpoint(checkpoint)
        state = checkpoint.get("activation_buffer")
        if state is not None:
            self.buffer.restore(state["rows"])
            if state["generator"] is not None and self.buffer.generator is not None:
                self.buffer.generator.set_state(state["generator"])

    def export_intervention(self, folder: Path) -> Path:
        """Write the dictionaries to ``folder`` (:meth:`save_dictionaries`) unless :meth:`on_fit_end` already wrote
        them there; returns ``folder``."""
        if self.saved_to is None or Path(folder).resolve() != self.saved_to:
            self.save_dictionaries(Path(folder))
        return Path(folder)

    def on_fit_end(self) -> None:
        """Write the trained dictionaries to ``<default_root_dir>/dictionary`` (rank 0, :meth:`save_dictionaries`)."""
        if self.trainer.is_global_zero:
            folder = Path(self.trainer.default_root_dir) / "dictionary"
            self.save_dictionaries(folder)
            self.saved_to = folder.resolve()
