"""Training a sparse dictionary in Lightning on activations streamed from a frozen PatchableGraph (local losses).

:class:`DictionaryModule` is a :class:`~recipes.training.frozen.FrozenGraphModule` whose trainable tensors are one
:class:`gradpatch.dictionaries.SparseDictionary`, or several at different nodes trained in one run (their rows side
by side in the buffer, their losses summed). Each training batch is token ids ``[batch, seq]`` without padding
(packed chunks of a corpus, what SAELens and sparsify train on; every position counts); the step

1. reads the dictionary's input node (and a transcoder's output node) in one forward pass of the frozen graph that
   stops after the deepest node read (:func:`gradpatch.capture.node_activations`), without gradients;
2. pushes those ``batch · seq`` rows (less the first ``exclude_first_positions`` of each sequence, the
   dictionaries' config's) into a bounded shuffle buffer
   (:class:`~recipes.dictionary.buffer.ActivationBuffer`) and, once it holds ``buffer_rows``, trains on as many rows
   drawn from it at random (steps before that only fill it);
3. minimises the local loss of the dictionary's kind (:mod:`gradpatch.dictionaries.losses`):

   - every kind: normalised MSE (FVU) of the prediction against the target (the input for an SAE, the output node's
     value for a transcoder);
   - TopK / BatchTopK: + ``auxk_coefficient`` · AuxK over the dead latents (Gao et al. 2024, appendix A.2;
     α = 1/32, k_aux = d_out / 2 as sparsify uses; divided by the residual's variance, or with
     ``auxk_normalization="target"`` by the target's as sparsify divides it: the same α weighs the two differently);
   - ReLU: + ``sparsity_coefficient`` · L1 (Σ |z_i| ‖W_dec[i]‖); JumpReLU: + ``sparsity_coefficient`` · L0 with the
     straight-through θ gradient (Rajamanoharan et al. 2024, eq. 12); logged as ``penalty``;
4. with ``unit_norm_decoder``, removes each decoder row's parallel gradient component before the optimizer step and
   renormalises the rows after it (Gao et al. section 2.2).

The settings that matter at small budgets (:mod:`recipes.dictionary.settings`, each cited there): ``b_dec_init``
(the decoder bias set from the first step's targets: their mean, or their geometric median), ``lr_warmup_steps`` and
``lr_decay_fraction`` (linear warm-up, linear decay to 0 over the run's last fraction), ``sparsity_warmup_steps``
(λ ramped up linearly), AuxK for dead latents (TopK, BatchTopK), ``skip_init`` (a skip transcoder's linear part
fitted by least squares before the first step) and ``exclude_first_positions`` (the dictionaries' configs).

A latent is dead when it has not fired on the last ``dead_after_tokens`` training tokens (Gao et al.: 10M). Logged
every step: ``fvu``, ``l0`` (mean active latents per token), ``dead_fraction`` and the loss terms; to TensorBoard
every ``density_every_n_steps`` optimizer steps, the histogram ``feature_density_log10`` of log10(fraction of the
window's training tokens on which each latent fired + 1e-10), as SAELens plots feature density (rank 0's tokens). At
the end of fit the dictionary is written with :func:`gradpatch.dictionaries.save_dictionary` to
``<default_root_dir>/dictionary`` (Lightning's ``default_root_dir`` is the working directory unless the ``Trainer``
is given one).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import Any, Literal

import torch
from lightning.pytorch.loggers import TensorBoardLogger
from torch import nn

from gradpatch.dictionaries import (DictionaryConfigError, DictionaryLayers, SparseDictionary, auxk_loss, jumprelu_l0,
                                    l1_penalty, normalized_mse, per_layer_dictionaries, remove_parallel_gradient,
                                    save_dictionary, sparse_decode, unit_norm_rows)
from gradpatch.dictionaries.splice import dictionary_nodes

from ..errors import RecipeConfigError
from ..training.frozen import OptimizerName
from .settings import least_squares_skip
from .spliced import spliced_ce_increase
from .streaming import BDecInit, StreamingModule

__all__ = ["AUXK_COEFFICIENT", "AuxKNormalization", "BDecInit", "DictionaryModule", "SkipInit"]

#: α of the AuxK term (Gao et al. 2024, appendix A.2).
AUXK_COEFFICIENT = 1 / 32
#: What AuxK is divided by: the residual's variance (Gao et al.) or the target's (sparsify).
AuxKNormalization = Literal["residual", "target"]
#: How a skip transcoder's ``W_skip`` starts: at 0, or fitted by least squares on the first rows.
SkipInit = Literal["zero", "least_squares"]


class DictionaryModule(StreamingModule):
    """Train one dictionary, or several at different nodes in one run, on the activations of ``pg`` (see the module
    docstring).

    With several dictionaries one forward pass reads every node they need, the buffer holds their rows side by side
    (so each step's draw is the same tokens for all), the loss is the sum of their local losses, and each term is
    logged per dictionary as ``<term>/<node>`` (``fvu/model.layers_3.output``); ``ce_increase`` is that of the model
    with all of them spliced.

    Args:
        pg: the :class:`gradpatch.PatchableGraph` (frozen by this module).
        dictionary: the SAE or transcoder to train, or a sequence of them; each config's ``input_node`` (and
            ``output_node``) name its nodes. Several dictionaries must write different nodes.
        buffer_rows: rows (tokens) the shuffle buffer holds before training starts and keeps holding; memory
            ``buffer_rows × Σ node widths × 4`` bytes in float32, allocated once (a draw copies the rows drawn only).
        lr, optimizer: as :class:`~recipes.training.frozen.FrozenGraphModule` (Adam, 2e-4 by default).
        sparsity_coefficient: λ of the L1 (ReLU) or L0 (JumpReLU) penalty.
        auxk_coefficient: α of AuxK (TopK, BatchTopK).
        auxk_normalization: ``"residual"`` (default): AuxK divided by the residual's variance Σ‖e − mean(e)‖²
            (normalized_mse(ê, e), Gao et al.'s normalised MSE of the residual); ``"target"``: by the target's
            Σ‖y − mean(y)‖², as sparsify divides it. The residual's variance is about FVU times the target's, so at
            the same α the default weighs AuxK 1 / FVU times more than sparsify
            (:func:`gradpatch.dictionaries.auxk_loss`); use ``"target"`` to compare with sparsify at its α.
        dead_after_tokens: a latent unfired for this many training tokens is dead.
        unit_norm_decoder: keep the decoder rows at unit norm.
        seed: the buffer's random draws.
        density_every_n_steps: optimizer steps per feature-density histogram (0: none).
        ce_every_n_steps: optimizer steps per logged ``ce_increase`` (0: none), measured on that step's batch of
            token ids after the update: CE with the dictionaries spliced without error terms − the model's CE.
        b_dec_init: ``"mean"`` (default): before the first optimizer step, each dictionary's ``b_dec`` is set to the
            mean of that step's targets (``[d_out]``; averaged over the DDP ranks), as sparsify does and SAELens's
            ``b_dec_init_method="mean"``: the reconstruction then starts at the activations' mean instead of 0 (on
            SmolLM2 at 65,536 tokens it left 0.3 % of the latents dead instead of 25 % and cut the CE increase from
            0.87 to 0.69, docs/dictionaries.md); ``"geometric_median"``: their geometric median (Bricken et al. 2023,
            SAELens's ``"geometric_median"``; :func:`~recipes.dictionary.settings.geometric_median`, averaged over
            the DDP ranks); ``"keep"``: leave ``b_dec`` as the dictionary has it. Kept in checkpoints: a resumed run
            does not set it again.
        lr_warmup_steps: optimizer steps of the learning rate's linear warm-up (0: none; sparsify and
            Rajamanoharan et al. 2024 warm up over 1,000; :func:`~recipes.dictionary.settings.lr_factor`).
        lr_decay_fraction: the last fraction of the run's optimizer steps over which the learning rate falls linearly
            to 0 (0: none; Conerly et al. 2024: 0.2). The run's steps are Lightning's estimate
            (``max_steps``, or the epochs' batches less those that only filled the buffer).
        sparsity_warmup_steps: optimizer steps over which λ (``sparsity_coefficient``) ramps up linearly from ~0
            (0: none; Rajamanoharan et al. 2024: 10,000 for JumpReLU).
        skip_init: ``"zero"`` (default): a skip transcoder's ``W_skip`` starts at 0 (Paulo et al. 2025);
            ``"least_squares"``: before the first optimizer step, with the decoder bias, each skip transcoder's
            ``W_skip`` and ``b_dec`` are set to the ridge regression of its targets on its inputs over that step's
            rows and the buffer's (:func:`~recipes.dictionary.settings.least_squares_skip`, averaged over the DDP
            ranks); the other dictionaries' ``b_dec`` as ``b_dec_init`` says. Needs ``b_dec_init`` other than
            ``"keep"``.
        skip_ridge: λ of that regression, relative to the inputs' mean variance.

    Raises:
        RecipeConfigError: no dictionary, a dictionary whose config names no input node (or no output node for a
            transcoder), two writing the same node or leaving out different first positions, a non-positive
            ``buffer_rows`` or ``dead_after_tokens``, a negative ``density_every_n_steps`` or ``ce_every_n_steps``, a
            ``b_dec_init`` other than ``"mean"``, ``"geometric_median"`` or ``"keep"``, an ``auxk_normalization``
            other than ``"residual"`` or ``"target"``, a negative warm-up or a decay fraction outside [0, 1], a
            ``skip_init`` other than ``"zero"`` or ``"least_squares"``, or ``"least_squares"`` with ``b_dec_init:
            keep`` or a negative ``skip_ridge``.
    """

    def __init__(self, pg: Any, dictionary: SparseDictionary | Sequence[SparseDictionary], buffer_rows: int = 65536,
                 lr: float = 2e-4, optimizer: OptimizerName = "adam", sparsity_coefficient: float = 1e-3,
                 auxk_coefficient: float = AUXK_COEFFICIENT, dead_after_tokens: int = 10_000_000,
                 unit_norm_decoder: bool = True, seed: int = 0, density_every_n_steps: int = 50,
                 ce_every_n_steps: int = 50, b_dec_init: BDecInit = "mean",
                 auxk_normalization: AuxKNormalization = "residual", lr_warmup_steps: int = 0,
                 lr_decay_fraction: float = 0.0, sparsity_warmup_steps: int = 0, skip_init: SkipInit = "zero",
                 skip_ridge: float = 1e-4) -> None:
        if auxk_normalization not in ("residual", "target"):
            raise RecipeConfigError(f"auxk_normalization must be 'residual' or 'target', got {auxk_normalization!r}")
        if skip_init not in ("zero", "least_squares") or skip_ridge < 0:
            raise RecipeConfigError(f"skip_init must be 'zero' or 'least_squares' (got {skip_init!r}) and "
                                    f"skip_ridge >= 0 (got {skip_ridge})")
        if skip_init == "least_squares" and b_dec_init == "keep":
            raise RecipeConfigError("skip_init='least_squares' sets b_dec with W_skip before the first step; give "
                                    "b_dec_init 'mean' or 'geometric_median' (for the other dictionaries), not 'keep'")
        dictionaries = [dictionary] if isinstance(dictionary, SparseDictionary) else list(dictionary)
        written = [_nodes(d)[-1] for d in dictionaries]
        if not dictionaries or len(set(written)) < len(written):
            raise RecipeConfigError(f"DictionaryModule needs one dictionary or several writing different nodes, got "
                                    f"{len(dictionaries)} writing {written}")
        if buffer_rows < 1 or dead_after_tokens < 1 or min(density_every_n_steps, ce_every_n_steps) < 0:
            raise RecipeConfigError(f"buffer_rows ({buffer_rows}) and dead_after_tokens ({dead_after_tokens}) must be "
                                    f"positive, density_every_n_steps ({density_every_n_steps}) and ce_every_n_steps "
                                    f"({ce_every_n_steps}) >= 0")
        excluded = {d.config.exclude_first_positions for d in dictionaries}
        if len(excluded) > 1:
            raise RecipeConfigError(f"the dictionaries of one run must leave out the same first positions (their rows "
                                    f"are the same tokens), got exclude_first_positions {sorted(excluded)}")
        super().__init__(pg, list(dict.fromkeys(node for d in dictionaries for node in _nodes(d))), excluded.pop(),
                         buffer_rows, lr, optimizer, seed, b_dec_init, lr_warmup_steps, lr_decay_fraction,
                         sparsity_warmup_steps)
        self.dictionaries = nn.ModuleList(dictionaries)
        self.skip_init: SkipInit = skip_init
        self.skip_ridge = float(skip_ridge)
        self.sparsity_coefficient = float(sparsity_coefficient)
        self.auxk_coefficient = float(auxk_coefficient)
        self.auxk_normalization: AuxKNormalization = auxk_normalization
        self.dead_after_tokens = int(dead_after_tokens)
        self.unit_norm_decoder = unit_norm_decoder
        self.density_every_n_steps = int(density_every_n_steps)
        self.ce_every_n_steps = int(ce_every_n_steps)
        #: Each dictionary's latents are a slice of the firing counters: offsets[i] .. offsets[i + 1].
        self.offsets = [0]
        for d in dictionaries:
            self.offsets.append(self.offsets[-1] + d.d_sae)
        self.register_buffer("tokens_since_fired", torch.zeros(self.offsets[-1], dtype=torch.long))
        #: Tokens each latent fired on, and tokens seen, since the last density histogram.
        self.register_buffer("window_fired", torch.zeros(self.offsets[-1]), persistent=False)
        self.window_tokens = 0

    @property
    def dictionary(self) -> SparseDictionary:
        """The dictionary trained (the first one when there are several)."""
        return self.dictionaries[0]

    def suffix(self, index: int) -> str:
        """What dictionary ``index``'s logged names end with: nothing for one dictionary, ``/<written node>``."""
        return "" if len(self.dictionaries) == 1 else "/" + _nodes(self.dictionaries[index])[-1]

    def initialize_from_rows(self, rows: torch.Tensor) -> None:
        """Set each dictionary's ``b_dec`` from its target columns of the first drawn ``rows`` (``b_dec_init``); with
        ``skip_init="least_squares"``, each skip transcoder's ``W_skip`` and ``b_dec`` from its columns of ``rows``
        and of the rows the buffer still holds."""
        fitted = self.fit_skips(rows) if self.skip_init == "least_squares" and bool(self.b_dec_pending) else set()
        self.initialize_b_dec(lambda index: self.columns(rows, self.nodes_of(index)[1]), fitted)

    def fit_skips(self, rows: torch.Tensor) -> set[int]:
        """Set each skip transcoder's ``W_skip`` and ``b_dec`` to the ridge regression of its target columns on its
        input columns of ``rows`` and the buffer's rows (:func:`~recipes.dictionary.settings.least_squares_skip`,
        averaged over the DDP ranks); returns the indices of the dictionaries set."""
        held = self.buffer.rows
        rows = rows if held is None else torch.cat([rows, held.to(rows)])
        fitted = set()
        with torch.no_grad():
            for index, dictionary in enumerate(self.dictionaries):
                if dictionary.config.kind != "skip_transcoder":
                    continue
                read, write = self.nodes_of(index)
                weight, bias = least_squares_skip(self.columns(rows, read), self.columns(rows, write), self.skip_ridge)
                reduce = self.trainer.strategy.reduce
                dictionary.W_skip.copy_(reduce(weight, reduce_op="mean").to(dictionary.W_skip))
                dictionary.b_dec.copy_(reduce(bias, reduce_op="mean").to(dictionary.b_dec))
                fitted.add(index)
        return fitted

    def layer_stack(self) -> DictionaryLayers | None:
        """The dictionaries as :class:`gradpatch.dictionaries.DictionaryLayers` (what ``metrics.json`` of several
        layers evaluates, :func:`gradpatch.dictionaries.evaluate_layers`); ``None`` for one dictionary."""
        return per_layer_dictionaries(list(self.dictionaries)) if len(self.dictionaries) > 1 else None

    def initialize_b_dec(self, targets: Callable[[int], torch.Tensor], fitted: Collection[int] = ()) -> None:
        """Before the first optimizer step (``b_dec_init`` not ``"keep"``): set dictionary ``index``'s ``b_dec`` to
        the mean or geometric median of ``targets(index)`` ``[n, d_out]``, averaged over the DDP ranks (each rank's
        batch has as many rows), but for the ``fitted`` indices (already set with their skip term); nothing
        afterwards."""
        if not bool(self.b_dec_pending):
            return
        with torch.no_grad():
            for index, dictionary in enumerate(self.dictionaries):
                if index in fitted:
                    continue
                dictionary.b_dec.copy_(self.data_center(targets(index)).to(dictionary.b_dec))
            self.b_dec_pending.fill_(False)

    def nodes_of(self, index: int) -> tuple[str, str]:
        """Dictionary ``index``'s (input node, target node); the same node twice for an SAE."""
        return _nodes(self.dictionaries[index])

    def columns(self, rows: torch.Tensor, node: str) -> torch.Tensor:
        """``node``'s columns of ``rows`` ``[n, Σ widths]`` (the nodes in :attr:`nodes` order)."""
        widths: dict[str, int] = {}
        for index, dictionary in enumerate(self.dictionaries):
            read, write = self.nodes_of(index)
            widths[read], widths[write] = dictionary.d_in, dictionary.d_out
        start = sum(widths[name] for name in self.nodes[:self.nodes.index(node)])
        return rows[:, start:start + widths[node]]

    def loss_terms(self, rows: torch.Tensor) -> dict[str, torch.Tensor]:
        """The local loss on ``rows`` ``[n, Σ widths]``: ``{"loss", "fvu", "l0", "dead_fraction", ...}`` (each name
        but ``loss`` suffixed per dictionary when there are several; ``loss`` their sum)."""
        terms: dict[str, torch.Tensor] = {}
        losses = []
        for index in range(len(self.dictionaries)):
            read, write = self.nodes_of(index)
            one = self.local_terms(index, self.columns(rows, read), self.columns(rows, write))
            losses.append(one.pop("loss"))
            terms.update({name + self.suffix(index): value for name, value in one.items()})
        terms["loss"] = torch.stack(losses).sum()
        self.log_terms(terms)
        return terms

    def local_terms(self, index: int, x: torch.Tensor, target: torch.Tensor) -> dict[str, torch.Tensor]:
        """Dictionary ``index``'s local loss on inputs ``x`` ``[n, d_in]`` against ``target`` ``[n, d_out]``:
        ``{"loss", "fvu", "l0", "dead_fraction", "auxk" or "penalty"}``."""
        dictionary = self.dictionaries[index]
        h = dictionary.pre_activations(x)
        if dictionary.config.activation == "topk":  # decoded from the k active latents only: n·k·d, not n·m·d
            values, indices = h.topk(int(dictionary.config.k), dim=-1, sorted=False)  # activations.topk's choice
            z = torch.zeros_like(h).scatter(-1, indices, values.relu().detach())  # for the firing statistics
            skipped = dictionary.skip(x)
            prediction = sparse_decode(indices, values.relu(), dictionary.W_dec) + dictionary.b_dec
            prediction = prediction if skipped is None else prediction + skipped
        else:
            z = dictionary.activate(h)
            prediction = dictionary.output(x, z)
        fvu = normalized_mse(prediction, target)
        dead = self.track_firing(index, z)
        terms = {"fvu": fvu, **self.sparsity_terms(index, h, z)}
        if dictionary.config.activation in ("topk", "batchtopk"):
            terms["auxk"] = auxk_loss(h, target - prediction, dictionary.W_dec, dead, max(dictionary.d_out // 2, 1),
                                      target=target if self.auxk_normalization == "target" else None)
            terms["loss"] = fvu + self.auxk_coefficient * terms["auxk"]
        else:
            terms["loss"] = fvu + self.sparsity_coefficient * self.sparsity_scale() * terms["penalty"]
        return {**terms, **self.firing_terms(index, z)}

    def track_firing(self, index: int, z: torch.Tensor) -> torch.Tensor:
        """Count dictionary ``index``'s latents ``z`` ``[n, m]`` into :attr:`tokens_since_fired` (0 for the latents
        that fired); returns its dead latents ``[m]`` (booleans)."""
        counters = slice(self.offsets[index], self.offsets[index + 1])
        with torch.no_grad():
            fired = z > 0
            since = self.tokens_since_fired[counters]
            since += z.shape[0]
            since[fired.any(0)] = 0
            self.window_fired[counters] += fired.sum(0).to(self.window_fired)
            if index == 0:
                self.window_tokens += z.shape[0]
        return since > self.dead_after_tokens

    def firing_terms(self, index: int, z: torch.Tensor) -> dict[str, torch.Tensor]:
        """``{"l0": mean active latents per token of z [n, m], "dead_fraction": of dictionary index}``."""
        since = self.tokens_since_fired[self.offsets[index]:self.offsets[index + 1]]
        return {"l0": (z > 0).float().sum(-1).mean().detach(),
                "dead_fraction": (since > self.dead_after_tokens).float().mean()}

    def sparsity_terms(self, index: int, h: torch.Tensor, z: torch.Tensor) -> dict[str, torch.Tensor]:
        """``{"penalty": ...}`` to weigh by λ: L1 for ReLU, L0 for JumpReLU; ``{}`` for TopK and BatchTopK."""
        dictionary = self.dictionaries[index]
        if dictionary.config.activation == "relu":
            return {"penalty": l1_penalty(z, dictionary.W_dec)}
        if dictionary.config.activation == "jumprelu":
            return {"penalty": jumprelu_l0(h, dictionary.threshold, dictionary.config.bandwidth)}
        return {}

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        """Remove each decoder row's gradient component along the row (unit-norm decoders)."""
        for dictionary in self.dictionaries if self.unit_norm_decoder else ():
            W_dec = dictionary.W_dec  # noqa: N806
            if W_dec.grad is not None:
                W_dec.grad = remove_parallel_gradient(W_dec.detach(), W_dec.grad)

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
        """The scheduled, checked optimizer step (:meth:`StreamingModule.optimizer_step`), then the decoder rows back
        to unit norm."""
        super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)
        if self.unit_norm_decoder:
            with torch.no_grad():
                for dictionary in self.dictionaries:
                    dictionary.W_dec.copy_(unit_norm_rows(dictionary.W_dec))

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        """After an optimizer step: every ``ce_every_n_steps``, ``ce_increase`` on the step's batch; every
        ``density_every_n_steps``, the window's feature-density histogram (per dictionary) to each TensorBoard
        logger, and the window starts again."""
        if outputs is None:
            return
        if self.ce_every_n_steps and self.global_step % self.ce_every_n_steps == 0:
            self.log_ce_increase(batch["input_ids"] if isinstance(batch, dict) else batch)
        if not self.density_every_n_steps or self.global_step % self.density_every_n_steps:
            return
        density = (self.window_fired / max(self.window_tokens, 1)).add(1e-10).log10().cpu()
        for logger in self.loggers:
            if isinstance(logger, TensorBoardLogger):
                for index in range(len(self.dictionaries)):
                    logger.experiment.add_histogram("feature_density_log10" + self.suffix(index),
                                                    density[self.offsets[index]:self.offsets[index + 1]],
                                                    self.global_step)
        self.window_fired.zero_()
        self.window_tokens = 0

    def log_ce_increase(self, ids: torch.Tensor) -> None:
        """Write ``ce_increase`` (:func:`~recipes.dictionary.spliced.spliced_ce_increase` on token ids ``[batch,
        seq]``) to each logger at this optimizer step (once: not through ``self.log``, which repeats a value logged
        after the step at the next steps)."""
        value = float(spliced_ce_increase(self.graph, list(self.dictionaries), ids))
        for logger in self.loggers:
            logger.log_metrics({"ce_increase": value}, step=self.global_step)

    def save_dictionaries(self, folder: Path) -> None:
        """One dictionary to ``folder``; several to ``folder/<written node>/`` each."""
        if len(self.dictionaries) == 1:
            save_dictionary(self.dictionary, folder, model=self.graph.wrapped_model)
            return
        for dictionary in self.dictionaries:
            save_dictionary(dictionary, folder / _nodes(dictionary)[-1], model=self.graph.wrapped_model)


def _nodes(dictionary: SparseDictionary) -> tuple[str, str]:
    """The NodePaths ``dictionary`` reads and writes (:func:`~gradpatch.dictionaries.splice.dictionary_nodes`): the
    same node twice for an SAE.

    Raises:
        RecipeConfigError: the config names no input node, or a transcoder's no output node.
    """
    try:
        return dictionary_nodes(dictionary)
    except DictionaryConfigError as error:  # a recipe configuration error to the recipe's callers
        raise RecipeConfigError(str(error)) from error
