"""Training a sparse dictionary in Lightning on activations streamed from a frozen PatchableGraph (local losses).

:class:`DictionaryModule` is a :class:`~recipes.training.frozen.FrozenGraphModule` whose trainable tensors are one
:class:`gradpatch.dictionaries.SparseDictionary`. Each training batch is token ids ``[batch, seq]`` without padding
(packed chunks of a corpus, what SAELens and sparsify train on; every position counts); the step

1. reads the dictionary's input node (and a transcoder's output node) in one forward pass of the frozen graph that
   stops after the deepest node read (:func:`editors.passes.node_activations`), without gradients;
2. pushes those ``batch · seq`` rows into a bounded shuffle buffer
   (:class:`~recipes.dictionary.buffer.ActivationBuffer`) and, once it holds ``buffer_rows``, trains on as many rows
   drawn from it at random (steps before that only fill it);
3. minimises the local loss of the dictionary's kind (:mod:`gradpatch.dictionaries.losses`):

   - every kind: normalised MSE (FVU) of the prediction against the target (the input for an SAE, the output node's
     value for a transcoder);
   - TopK / BatchTopK: + ``auxk_coefficient`` · AuxK over the dead latents (Gao et al. 2024, appendix A.2;
     α = 1/32, k_aux = d_out / 2 as sparsify uses);
   - ReLU: + ``sparsity_coefficient`` · L1 (Σ |z_i| ‖W_dec[i]‖); JumpReLU: + ``sparsity_coefficient`` · L0 with the
     straight-through θ gradient (Rajamanoharan et al. 2024, eq. 12); logged as ``penalty``;
4. with ``unit_norm_decoder``, removes each decoder row's parallel gradient component before the optimizer step and
   renormalises the rows after it (Gao et al. section 2.2).

A latent is dead when it has not fired on the last ``dead_after_tokens`` training tokens (Gao et al.: 10M). Logged
every step: ``fvu``, ``l0`` (mean active latents per token), ``dead_fraction`` and the loss terms; to TensorBoard
every ``density_every_n_steps`` optimizer steps, the histogram ``feature_density_log10`` of log10(fraction of the
window's training tokens on which each latent fired + 1e-10), as SAELens plots feature density (rank 0's tokens). At
the end of fit the dictionary is written with :func:`gradpatch.dictionaries.save_dictionary` to
``<default_root_dir>/dictionary`` (Lightning's ``default_root_dir`` is the working directory unless the ``Trainer``
is given one).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.loggers import TensorBoardLogger

from editors.passes import node_activations
from gradpatch.finite import StepGuard
from gradpatch.dictionaries import (SparseDictionary, auxk_loss, jumprelu_l0, l1_penalty, normalized_mse,
                                    remove_parallel_gradient, save_dictionary, unit_norm_rows)

from ..errors import RecipeConfigError
from ..training.frozen import FrozenGraphModule, OptimizerName
from .buffer import ActivationBuffer

__all__ = ["AUXK_COEFFICIENT", "DictionaryModule"]

#: α of the AuxK term (Gao et al. 2024, appendix A.2).
AUXK_COEFFICIENT = 1 / 32


class DictionaryModule(FrozenGraphModule):
    """Train ``dictionary`` on the activations of ``pg`` (see the module docstring).

    Args:
        pg: the :class:`gradpatch.PatchableGraph` (frozen by this module).
        dictionary: the SAE or transcoder to train; its config's ``input_node`` (and ``output_node``) name the nodes.
        buffer_rows: rows (tokens) the shuffle buffer holds before training starts and keeps holding; memory
            ``buffer_rows × (d_in + d_out) × 4`` bytes in float32, allocated once (a draw copies the rows drawn only).
        lr, optimizer: as :class:`~recipes.training.frozen.FrozenGraphModule` (Adam, 2e-4 by default).
        sparsity_coefficient: λ of the L1 (ReLU) or L0 (JumpReLU) penalty.
        auxk_coefficient: α of AuxK (TopK, BatchTopK).
        dead_after_tokens: a latent unfired for this many training tokens is dead.
        unit_norm_decoder: keep the decoder rows at unit norm.
        seed: the buffer's random draws.
        density_every_n_steps: optimizer steps per feature-density histogram (0: none).

    Raises:
        RecipeConfigError: no input node in the dictionary's config (or no output node for a transcoder), or a
            non-positive ``buffer_rows`` or ``dead_after_tokens``, a negative ``density_every_n_steps``.
    """

    def __init__(self, pg: Any, dictionary: SparseDictionary, buffer_rows: int = 65536, lr: float = 2e-4,
                 optimizer: OptimizerName = "adam", sparsity_coefficient: float = 1e-3,
                 auxk_coefficient: float = AUXK_COEFFICIENT, dead_after_tokens: int = 10_000_000,
                 unit_norm_decoder: bool = True, seed: int = 0, density_every_n_steps: int = 50) -> None:
        super().__init__(lr=lr, optimizer=optimizer)
        config = dictionary.config
        nodes = [config.input_node] + ([config.output_node] if config.kind != "sae" else [])
        if any(node is None for node in nodes):
            raise RecipeConfigError(f"the {config.kind}'s config names no node to train on: build it with "
                                    f"node=... (SAE) or input_node=... and output_node=... (transcoder)")
        if buffer_rows < 1 or dead_after_tokens < 1 or density_every_n_steps < 0:
            raise RecipeConfigError(f"buffer_rows ({buffer_rows}) and dead_after_tokens ({dead_after_tokens}) must be "
                                    f"positive, density_every_n_steps ({density_every_n_steps}) >= 0")
        self.attach_graph(pg)
        self.dictionary = dictionary
        self.nodes: list[str] = [str(node) for node in nodes]
        self.sparsity_coefficient = float(sparsity_coefficient)
        self.auxk_coefficient = float(auxk_coefficient)
        self.dead_after_tokens = int(dead_after_tokens)
        self.unit_norm_decoder = unit_norm_decoder
        self.buffer = ActivationBuffer(buffer_rows, torch.Generator().manual_seed(seed))
        self.density_every_n_steps = int(density_every_n_steps)
        self.register_buffer("tokens_since_fired", torch.zeros(dictionary.d_sae, dtype=torch.long))
        #: Tokens each latent fired on, and tokens seen, since the last density histogram.
        self.register_buffer("window_fired", torch.zeros(dictionary.d_sae), persistent=False)
        self.window_tokens = 0
        self.saved_to: Path | None = None

    def step_guard(self) -> StepGuard:
        """How a non-finite step is reported (a :class:`gradpatch.errors.NonFiniteError`; nothing is written)."""
        return StepGuard(type(self).__name__, f"lower the learning rate (lr={self.lr:g}) or check the dictionary's "
                                              f"starting weights; no dictionary was written")

    def setup(self, stage: str) -> None:
        """Silence Lightning's warning about steps that return ``None``: the steps that fill the buffer do."""
        super().setup(stage)
        warnings.filterwarnings("ignore", message=r"`training_step` returned `None`")

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any] | None:
        """Stream one batch of token ids into the buffer; train on as many buffered rows once it is full (``None``,
        no optimizer step, while it fills)."""
        ids = batch["input_ids"] if isinstance(batch, dict) else batch
        activations = node_activations(self.graph, self.nodes, ids)
        rows = torch.cat([a.reshape(-1, a.shape[-1]).float() for a in activations], dim=-1)
        self.buffer.push(rows)
        if not self.buffer.ready(rows.shape[0]):
            return None
        return super().training_step(self.buffer.pop(rows.shape[0]), batch_idx)

    def loss_terms(self, rows: torch.Tensor) -> dict[str, torch.Tensor]:
        """The local loss on ``rows`` ``[n, d_in (+ d_out)]``: ``{"loss", "fvu", "l0", "dead_fraction", ...}``."""
        dictionary = self.dictionary
        x = rows[:, :dictionary.d_in]
        target = x if dictionary.config.kind == "sae" else rows[:, dictionary.d_in:]
        h = dictionary.pre_activations(x)
        z = dictionary.activate(h)
        prediction = dictionary.output(x, z)
        fvu = normalized_mse(prediction, target)
        dead = self.track_firing(z)
        terms = {"fvu": fvu, **self.sparsity_terms(h, z)}
        if dictionary.config.activation in ("topk", "batchtopk"):
            terms["auxk"] = auxk_loss(h, target - prediction, dictionary.W_dec, dead, max(dictionary.d_out // 2, 1))
            terms["loss"] = fvu + self.auxk_coefficient * terms["auxk"]
        else:
            terms["loss"] = fvu + self.sparsity_coefficient * terms["penalty"]
        return self.logged(terms, z)

    def track_firing(self, z: torch.Tensor) -> torch.Tensor:
        """Count ``z``'s ``[n, m]`` tokens into :attr:`tokens_since_fired` (0 for the latents that fired); returns the
        dead latents ``[m]`` (booleans)."""
        with torch.no_grad():
            self.tokens_since_fired += z.shape[0]
            self.tokens_since_fired[(z > 0).any(0)] = 0
            self.window_fired += (z > 0).sum(0).to(self.window_fired)
            self.window_tokens += z.shape[0]
        return self.tokens_since_fired > self.dead_after_tokens

    def sparsity_terms(self, h: torch.Tensor, z: torch.Tensor) -> dict[str, torch.Tensor]:
        """``{"penalty": ...}`` to weigh by λ: L1 for ReLU, L0 for JumpReLU; ``{}`` for TopK and BatchTopK."""
        config = self.dictionary.config
        if config.activation == "relu":
            return {"penalty": l1_penalty(z, self.dictionary.W_dec)}
        if config.activation == "jumprelu":
            return {"penalty": jumprelu_l0(h, self.dictionary.threshold, config.bandwidth)}
        return {}

    def logged(self, terms: dict[str, torch.Tensor], z: torch.Tensor) -> dict[str, torch.Tensor]:
        """``terms`` with ``l0`` (mean active latents per token of ``z``) and ``dead_fraction`` added, all but
        ``loss`` logged."""
        terms["l0"] = (z > 0).float().sum(-1).mean().detach()
        terms["dead_fraction"] = (self.tokens_since_fired > self.dead_after_tokens).float().mean()
        self.log_dict({name: value.detach() for name, value in terms.items() if name != "loss"}, on_step=True,
                      on_epoch=False, batch_size=z.shape[0])
        return terms

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        """Remove each decoder row's gradient component along the row (unit-norm decoders)."""
        W_dec = self.dictionary.W_dec  # noqa: N806
        if self.unit_norm_decoder and W_dec.grad is not None:
            W_dec.grad = remove_parallel_gradient(W_dec.detach(), W_dec.grad)

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
        """The checked optimizer step, then the decoder rows back to unit norm."""
        super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)
        if self.unit_norm_decoder:
            with torch.no_grad():
                self.dictionary.W_dec.copy_(unit_norm_rows(self.dictionary.W_dec))

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        """Every ``density_every_n_steps`` optimizer steps, the window's feature-density histogram to each
        TensorBoard logger; the window then starts again."""
        if outputs is None or not self.density_every_n_steps or self.global_step % self.density_every_n_steps:
            return
        density = (self.window_fired / max(self.window_tokens, 1)).add(1e-10).log10().cpu()
        for logger in self.loggers:
            if isinstance(logger, TensorBoardLogger):
                logger.experiment.add_histogram("feature_density_log10", density, self.global_step)
        self.window_fired.zero_()
        self.window_tokens = 0

    def export_intervention(self, folder: Path) -> Path:
        """Write the dictionary to ``folder`` (:func:`gradpatch.dictionaries.save_dictionary`, with the model's
        fingerprint), unless :meth:`on_fit_end` already wrote it there; returns ``folder``."""
        if self.saved_to is None or Path(folder).resolve() != self.saved_to:
            save_dictionary(self.dictionary, folder, model=self.graph.wrapped_model)
        return Path(folder)

    def on_fit_end(self) -> None:
        """Write the trained dictionary to ``<default_root_dir>/dictionary`` (rank 0), with the model's fingerprint."""
        if self.trainer.is_global_zero:
            folder = Path(self.trainer.default_root_dir) / "dictionary"
            save_dictionary(self.dictionary, folder, model=self.graph.wrapped_model)
            self.saved_to = folder.resolve()
