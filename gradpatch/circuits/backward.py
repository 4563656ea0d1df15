"""One forward pass of the local replacement model kept for many backward passes (circuit-tracer's method:
Ameisen et al. 2025, "Circuit Tracing", appendix "Attribution graph computation"; circuit-tracer's
``AttributionContext.compute_batch``).

The replacement model (:mod:`gradpatch.circuits.replacement`) runs once on ``batch`` copies of the prompt with its
autograd graph kept. A backward pass then injects, in each row, the gradient of that row's target and reads the
gradient at every MLP output and at the token embeddings; rows are independent copies, so one backward pass gives
``batch`` targets' gradients, and the graph serves every backward pass (``retain_graph=True``):

- a feature target h_ℓpf = x_ℓp · W_enc[:, f] + b_enc[f]: the gradient W_enc[:, f] injected at x_ℓ (the MLP input,
  ``[batch, seq, d_in]``), row r, position p; only layers below ℓ receive gradient;
- a logit target logit_t − mean_v logit_v at the last position: the gradient e_t − 1/V at the last position's
  logits ``[vocab]``. Where the model layout names the unembedding's input h (:func:`gradpatch.layouts.logits_input`,
  ``[batch, seq, d_model]``), the unembedding runs on one row of its last position alone, from a leaf copy of h's
  row 0: u_t = ∂(logit_t − mean_v logit_v)/∂h is taken there (one small backward pass through the unembedding and
  any op after it, such as Gemma 2's linearised soft-capping, tied embeddings or a logit scale alike) and
  injected at h, row r, last position. Every row's h equals row 0's in this forward pass (no perturbation), so
  u_t is the gradient the full ``[batch, vocab]`` logits would have passed down; the vocabulary projection of
  ``batch`` rows, forward and backward, is not computed (circuit-tracer injects its demeaned unembedding vectors at
  the final norm's output likewise). Without a layout, e_t − 1/V is injected at the ``[batch, vocab]`` logits.

The model's and the transcoders' parameters do not require gradients during the forward pass, so that autograd
keeps only what the gradients with respect to activations need.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..layouts import last_position_cut, logits_input
from ..model_io import frozen_parameters
from ..patches import CustomPatch, HoldPatch, Patch
from .replacement import ReplacementModel

__all__ = ["RetainedForward", "SavedBytes", "Target", "measure_saved_bytes"]


@dataclass(frozen=True)
class Target:
    """A target node: ``kind`` ``"feature"`` (``layer``, ``position``, ``feature``) or ``"logit"`` (``feature`` =
    the token id; ``layer`` and ``position`` unused)."""

    kind: str
    layer: int
    position: int
    feature: int


class RetainedForward:
    """The replacement model's forward pass on ``batch`` copies of the prompt, kept for backward passes.

    Args:
        model: the local replacement model.
        batch: rows (targets per backward pass).

    Attributes:
        inputs: layer -> x_ℓ ``[batch, seq, d_in]``.
        outputs: layer -> the MLP output ``[batch, seq, d_out]``.
        embeddings: the token embeddings ``[batch, seq, d_model]`` (a leaf).
        logits: the last position's logits: ``[1, vocab]`` computed from :attr:`head_leaf` where the layout names
            the unembedding's input, else ``[batch, vocab]``.
        head_input: the unembedding's input at the last position ``[batch, 1, d_model]`` (``None`` without a
            layout).
        head_leaf: the leaf copy of its row 0 that the unembedding ran on ``[1, 1, d_model]`` (``None`` likewise).
    """

    def __init__(self, model: ReplacementModel, batch: int) -> None:
        self.model = model
        self.batch = batch
        held = {layer: HoldPatch() for layer in model.layers}
        embed = HoldPatch(leaf=True)
        patches: dict[str, list[Patch]] = {model.embed: [embed]}
        for layer, spliced in model.layers.items():
            patches.setdefault(spliced.output_node, []).append(held[layer])
        cut = logits_input(model.pg)
        head = HoldPatch()
        self.head_leaf: torch.Tensor | None = None
        if cut is not None:
            patches.setdefault(cut, []).extend([last_position_cut(), head,
                                                CustomPatch(custom_op=self._first_row_leaf, requires_clone=False)])
        with torch.enable_grad(), frozen_parameters(model.pg, *(s.transcoder for s in model.layers.values())):
            run = model.run(batch, patches=patches)
            self.logits = run.logits[:, -1].clone()  # not a view: the full logits are not kept
        self.head_input: torch.Tensor | None = head.held
        self._directions: dict[int, torch.Tensor] = {}
        self.inputs = run.inputs
        self.outputs = {layer: holder.held for layer, holder in held.items()}
        self.embeddings = embed.held

    def _first_row_leaf(self, value: torch.Tensor) -> torch.Tensor:
        """A leaf copy of ``value``'s row 0 ``[1, 1, d_model]``, kept as :attr:`head_leaf` (the unembedding's
        input for the rest of the forward pass)."""
        self.head_leaf = value[:1].detach().requires_grad_()
        return self.head_leaf

    def _direction(self, token: int) -> torch.Tensor:
        """u_t = ∂(logit_t − mean_v logit_v)/∂h at the last position ``[d_model]`` (module docstring), computed once
        per token."""
        if token not in self._directions:
            gradient = torch.full_like(self.logits, -1.0 / self.logits.shape[-1])
            gradient[:, token] += 1.0
            (direction,) = torch.autograd.grad(self.logits, self.head_leaf, gradient, retain_graph=True)
            self._directions[token] = direction[0, -1]
        return self._directions[token]

    def gradients(self, targets: Sequence[Target]) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
        """One backward pass: row r's gradient of ``targets[r]`` (at most ``batch`` targets; further rows get none).

        Returns:
            layer -> ∂target/∂(MLP output) ``[batch, seq, d_out]`` for the layers below the highest target (the
            others' are zero and left out), and ∂target/∂(embeddings) ``[batch, seq, d_model]``.
        """
        outputs: list[torch.Tensor] = []
        injected: list[torch.Tensor] = []
        features: dict[int, list[tuple[int, Target]]] = {}
        logits = [(row, target) for row, target in enumerate(targets) if target.kind == "logit"]
        for row, target in enumerate(targets):
            if target.kind == "feature":
                features.setdefault(target.layer, []).append((row, target))
        for layer, chosen in features.items():
            x = self.inputs[layer]
            gradient = torch.zeros_like(x)
            rows = torch.tensor([row for row, _ in chosen], device=x.device)
            positions = torch.tensor([t.position for _, t in chosen], device=x.device)
            ids = torch.tensor([t.feature for _, t in chosen], device=x.device)
            encoder = self.model.layers[layer].transcoder.W_enc.detach()  # [d_in, m]
            gradient[rows, positions] = encoder[:, ids].T.to(x.dtype)
            outputs.append(x)
            injected.append(gradient)
        if logits and self.head_input is not None:
            gradient = torch.zeros_like(self.head_input)
            for row, target in logits:
                gradient[row, -1] = self._direction(target.feature).to(gradient.dtype)
            outputs.append(self.head_input)
            injected.append(gradient)
        elif logits:
            gradient = torch.zeros_like(self.logits)
            rows = torch.tensor([row for row, _ in logits], device=gradient.device)
            gradient[rows] = -1.0 / gradient.shape[-1]
            gradient[rows, torch.tensor([t.feature for _, t in logits], device=gradient.device)] += 1.0
            outputs.append(self.logits)
            injected.append(gradient)
        top = max(self.model.layers) + 1 if logits else max(features)
        layers = [layer for layer in sorted(self.model.layers) if layer < top]
        inputs = [self.outputs[layer] for layer in layers] + [self.embeddings]
        grads = torch.autograd.grad(outputs, inputs, injected, retain_graph=True, allow_unused=True)
        by_layer = {layer: g for layer, g in zip(layers, grads[:-1]) if g is not None}
        embed = grads[-1] if grads[-1] is not None else torch.zeros_like(self.embeddings)
        return by_layer, embed


@dataclass(frozen=True)
class SavedBytes:
    """What one forward pass of the replacement model keeps for backward passes, measured (parameters, held
    anyway, left out).

    Attributes:
        fixed: bytes kept whatever the batch (shared values, e.g. the frozen attention inputs).
        per_row: bytes kept per row of the batch.
        transient_per_row: bytes per row saved during the forward pass and freed before its end (the replaced
            MLPs' and frozen nodes' own computations), per spliced layer: an upper estimate of the forward pass's
            peak above what it keeps (a layer's are freed before the next layer's are saved).
    """

    fixed: int
    per_row: int
    transient_per_row: int


def _saved_bytes(model: ReplacementModel, batch: int) -> tuple[int, int]:
    """Bytes that autograd saves in a forward pass of ``batch`` rows, parameters left out: (the distinct storages
    kept after the pass, the storages saved and freed during it, each time counted)."""
    saved: list[tuple[weakref.ref[torch.Tensor], int]] = []
    modules = [model.pg.wrapped_model, *(spliced.transcoder for spliced in model.layers.values())]
    parameters = {p.untyped_storage().data_ptr() for module in modules for p in module.parameters()}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        packed = tensor.detach()  # the tensor itself would make a cycle with its grad_fn (never freed)
        if tensor.untyped_storage().data_ptr() not in parameters:
            saved.append((weakref.ref(packed), tensor.untyped_storage().nbytes()))
        return packed

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        forward = RetainedForward(model, batch)
    alive = [(ref(), size) for ref, size in saved]
    kept = {t.untyped_storage().data_ptr(): size for t, size in alive if t is not None}
    freed = sum(size for t, size in alive if t is None)
    del forward, alive
    return sum(kept.values()), freed


def measure_saved_bytes(model: ReplacementModel) -> SavedBytes:
    """The :class:`SavedBytes` of ``model``, from forward passes of 1 and 2 rows (what is kept grows linearly
    with the rows)."""
    kept_1, freed_1 = _saved_bytes(model, 1)
    kept_2, freed_2 = _saved_bytes(model, 2)
    per_row = max(kept_2 - kept_1, 0)
    freed_per_row = max(freed_2 - freed_1, 0)
    return SavedBytes(max(kept_1 - per_row, 0), per_row, freed_per_row // max(len(model.layers), 1))
