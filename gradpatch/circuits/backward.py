"""One forward pass of the local replacement model kept for many backward passes (circuit-tracer's method:
Ameisen et al. 2025, "Circuit Tracing", appendix "Attribution graph computation"; circuit-tracer's
``AttributionContext.compute_batch``).

The replacement model (:mod:`gradpatch.circuits.replacement`) runs once on one row, the prompt, with its autograd
graph kept. A backward pass then injects, in each of ``batch`` rows, the gradient of that row's target and reads the
gradient at every MLP output and at the token embeddings. The rows are one backward pass vectorised over the injected
gradients (``torch.autograd.grad(..., is_grads_batched=True)``, i.e. ``torch.vmap`` over the backward graph): the
same gradients as a forward pass of ``batch`` copies of the prompt would give (the replacement model's backward is
linear in the injected gradient and the same for every row), without that pass (its activations, the graphs of
batched calls) and without rows left empty, and the graph serves every backward pass (``retain_graph=True``):

- a feature target h_ℓpf = x_ℓp · W_enc[:, f] + b_enc[f]: the gradient W_enc[:, f] injected at x_ℓ (the MLP input,
  ``[1, seq, d_in]``), row r, position p; only layers below ℓ receive gradient;
- a logit target logit_t − mean_v logit_v at the last position: the gradient e_t − 1/V at the last position's
  logits ``[vocab]``. Where the model layout names the unembedding's input h (:func:`gradpatch.layouts.logits_input`,
  ``[1, seq, d_model]``), the unembedding runs on its last position alone, from a leaf copy of h there: u_t =
  ∂(logit_t − mean_v logit_v)/∂h is taken there (one small backward pass through the unembedding and any op after
  it, such as Gemma 2's linearised soft-capping, tied embeddings or a logit scale alike) and injected at h, row r,
  last position (circuit-tracer injects its demeaned unembedding vectors at the final norm's output likewise).
  Without a layout, e_t − 1/V is injected at the ``[1, vocab]`` logits.

A target at position p depends on positions ≤ p alone (the frozen attention patterns are causal), so a forward pass
of the prompt's first ``length`` positions (:meth:`ReplacementModel.run`'s ``length``) serves the targets before
``length``: its backward passes are shorter (:mod:`gradpatch.circuits.batches` chooses the lengths).

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
from .errors import CircuitError
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
    """The replacement model's forward pass on the prompt (or its first ``length`` positions), kept for backward
    passes of up to ``batch`` rows each.

    Args:
        model: the local replacement model.
        batch: rows (targets) per backward pass, at most.
        length: the positions run (the first ``length``; ``None``: the whole prompt). Targets at positions
            ``< length`` alone; logit targets need the whole prompt.

    Attributes:
        length: the positions run.
        inputs: layer -> x_ℓ ``[1, length, d_in]``.
        outputs: layer -> the MLP output ``[1, length, d_out]``.
        embeddings: the token embeddings ``[1, length, d_model]`` (a leaf).
        logits: the last position's logits ``[1, vocab]``; ``None`` for a forward pass shorter than the prompt
            (where the layout names the unembedding's input, the unembedding then runs on no position).
        head_input: the unembedding's input at the last position ``[1, 1, d_model]`` (``None`` without a layout or
            for a shorter forward pass).
        head_leaf: the leaf copy of it that the unembedding ran on ``[1, 1, d_model]`` (``None`` likewise).
    """

    def __init__(self, model: ReplacementModel, batch: int, length: int | None = None) -> None:
        self.model = model
        self.batch = batch
        self.length = model.ids.shape[1] if length is None else length
        held = {layer: HoldPatch() for layer in model.layers}
        embed = HoldPatch(leaf=True)
        patches: dict[str, list[Patch]] = {model.embed: [embed]}
        for layer, spliced in model.layers.items():
            patches.setdefault(spliced.output_node, []).append(held[layer])
        whole = self.length == model.ids.shape[1]
        cut = logits_input(model.pg)
        head = HoldPatch()
        self.head_leaf: torch.Tensor | None = None
        if cut is not None:
            patches.setdefault(cut, []).extend([last_position_cut(), head,
                                                CustomPatch(custom_op=self._leaf, requires_clone=False)] if whole
                                               else [CustomPatch(custom_op=_no_position, requires_clone=False)])
        with torch.enable_grad(), frozen_parameters(model.pg, *(s.transcoder for s in model.layers.values())):
            run = model.run(1, patches=patches, length=length)
            self.logits = run.logits[:, -1].clone() if whole else None  # a copy: the full logits are not kept
        self.head_input: torch.Tensor | None = head.held
        self._directions: dict[int, torch.Tensor] = {}
        self.inputs = run.inputs
        self.outputs = {layer: holder.held for layer, holder in held.items()}
        self.embeddings = embed.held

    def _leaf(self, value: torch.Tensor) -> torch.Tensor:
        """A leaf copy of ``value`` ``[1, 1, d_model]``, kept as :attr:`head_leaf` (the unembedding's input for the
        rest of the forward pass)."""
        self.head_leaf = value.detach().requires_grad_()
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
        """One backward pass: row r's gradient of ``targets[r]`` (at most ``batch`` targets, each at a position
        below :attr:`length`).

        Returns:
            layer -> ∂target/∂(MLP output) ``[len(targets), length, d_out]`` for the layers below the highest
            target (the others' are zero and left out), and ∂target/∂(embeddings) ``[len(targets), length,
            d_model]``.

        Raises:
            CircuitError: more than ``batch`` targets, or a target this forward pass does not reach (a feature at a
                position ≥ :attr:`length`, a logit of a forward pass shorter than the prompt).
        """
        rows = len(targets)
        if rows > self.batch or any(t.position >= self.length for t in targets if t.kind == "feature") or (
                self.length < self.model.ids.shape[1] and any(t.kind == "logit" for t in targets)):
            raise CircuitError(f"a backward pass of {rows} targets over {self.length} positions: give at most "
                               f"{self.batch}, features before position {self.length}, logits on the whole prompt")
        outputs: list[torch.Tensor] = []
        injected: list[torch.Tensor] = []
        features: dict[int, list[tuple[int, Target]]] = {}
        logits = [(row, target) for row, target in enumerate(targets) if target.kind == "logit"]
        for row, target in enumerate(targets):
            if target.kind == "feature":
                features.setdefault(target.layer, []).append((row, target))
        for layer, chosen in features.items():
            x = self.inputs[layer]
            gradient = x.new_zeros((rows, *x.shape))
            where = torch.tensor([(row, t.position) for row, t in chosen], device=x.device).T
            ids = torch.tensor([t.feature for _, t in chosen], device=x.device)
            encoder = self.model.layers[layer].transcoder.W_enc.detach()  # [d_in, m]
            gradient[where[0], 0, where[1]] = encoder[:, ids].T.to(x.dtype)
            outputs.append(x)
            injected.append(gradient)
        if logits and self.head_input is not None:
            gradient = self.head_input.new_zeros((rows, *self.head_input.shape))
            for row, target in logits:
                gradient[row, 0, -1] = self._direction(target.feature).to(gradient.dtype)
            outputs.append(self.head_input)
            injected.append(gradient)
        elif logits:
            gradient = self.logits.new_zeros((rows, *self.logits.shape))
            where = torch.tensor([row for row, _ in logits], device=gradient.device)
            gradient[where] = -1.0 / gradient.shape[-1]
            gradient[where, 0, torch.tensor([t.feature for _, t in logits], device=gradient.device)] += 1.0
            outputs.append(self.logits)
            injected.append(gradient)
        top = max(self.model.layers) + 1 if logits else max(features)
        layers = [layer for layer in sorted(self.model.layers) if layer < top]
        inputs = [self.outputs[layer] for layer in layers] + [self.embeddings]
        grads = torch.autograd.grad(outputs, inputs, injected, retain_graph=True, allow_unused=True,
                                    is_grads_batched=True)
        by_layer = {layer: g[:, 0] for layer, g in zip(layers, grads[:-1]) if g is not None}
        embed = grads[-1][:, 0] if grads[-1] is not None else self.embeddings.new_zeros((rows,
                                                                                          *self.embeddings.shape[1:]))
        return by_layer, embed


def _no_position(value: torch.Tensor) -> torch.Tensor:
    """``value`` ``[batch, seq, ...]`` at no position (what follows it is not needed)."""
    return value[:, :0]


@dataclass(frozen=True)
class SavedBytes:
    """What one forward pass of the replacement model keeps for backward passes, measured (the parameters and what
    the replacement model recorded, :meth:`~gradpatch.circuits.ReplacementModel.recorded_tensors`, held anyway, left
    out: the frozen attention patterns are most of a long prompt's).

    Attributes:
        kept: bytes kept after the pass beyond those (0 where every nonlinearity is frozen or replaced).
        transient: bytes saved during the pass and freed before its end (the replaced MLPs' and frozen nodes' own
            computations): an upper estimate of the pass's peak above what it keeps.
    """

    kept: int
    transient: int


def measure_saved_bytes(model: ReplacementModel) -> SavedBytes:
    """The :class:`SavedBytes` of a :class:`RetainedForward` of ``model``'s whole prompt (whatever its ``batch``:
    the forward pass runs one row)."""
    saved: list[tuple[weakref.ref[torch.Tensor], int]] = []
    modules = [model.pg.wrapped_model, *(spliced.transcoder for spliced in model.layers.values())]
    held = {p.untyped_storage().data_ptr() for module in modules for p in module.parameters()}
    held |= {t.untyped_storage().data_ptr() for t in model.recorded_tensors()}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        packed = tensor.detach()  # the tensor itself would make a cycle with its grad_fn (never freed)
        if tensor.untyped_storage().data_ptr() not in held:
            saved.append((weakref.ref(packed), tensor.untyped_storage().nbytes()))
        return packed

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        forward = RetainedForward(model, 1)
    alive = [(ref(), size) for ref, size in saved]
    kept = {t.untyped_storage().data_ptr(): size for t, size in alive if t is not None}
    freed = sum(size for t, size in alive if t is None)
    del forward, alive
    return SavedBytes(sum(kept.values()), freed)
