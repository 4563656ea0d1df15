"""Trainable subspace patches: interchange interventions with learned parameters (DAS, Boundless DAS, masks).

Each patch is an ``nn.Module`` *and* a :class:`~gradpatch.patches.Patch`: it goes into ``pg.patch`` and into an
:class:`~gradpatch.interventions.Intervention` like any patch, and its parameters are what an optimiser trains.
It maps a base activation ``b`` and a source activation ``s`` (both ``[..., d]``, ``d`` the node's width) to the
intervened activation; :mod:`gradpatch.interventions.interchange` runs the source and base inputs and gives each patch
both. Used directly in ``pg.patch``, a patch takes its source from :attr:`TrainablePatch.source` (a fixed ``[d]`` or
``[batch, d]`` activation, e.g. recorded from a source prompt) and applies at ``slice``.

- :class:`RotatedSubspacePatch`: distributed interchange intervention, DII(b, s) = b + Rᵀ(R s − R b) with
  R ∈ ℝ^{k×d} of orthonormal rows (Geiger et al. 2023, "Finding Alignments Between Interpretable Causal Variables
  and Distributed Neural Representations", section 3). R is kept orthonormal by
  ``torch.nn.utils.parametrizations.orthogonal``.
- :class:`BoundlessSubspacePatch`: a full rotation R ∈ ℝ^{d×d} and a learned soft boundary,
  b + Rᵀ(m ⊙ (R s − R b)) with m_i = σ((β·d − i)/τ), β ∈ [0, 1] learned, τ annealed (Wu et al. 2023, "Interpretability
  at Scale: Identifying Causal Mechanisms in Alpaca", section 3).
- :class:`SigmoidMaskPatch`: (1 − σ(m/τ)) ⊙ b + σ(m/τ) ⊙ s per dimension, with :meth:`SigmoidMaskPatch.penalty`
  the L1 norm of the mask (De Cao et al. 2020's differentiable masking, as pyvene's ``SigmoidMaskIntervention``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.nn.utils import parametrizations, parametrize

from ..errors import PatchShapeError, SubspaceConfigError
from ..patches import Patch, Slice

__all__ = ["BoundlessSubspacePatch", "FullInterchangePatch", "RotatedSubspacePatch", "SigmoidMaskPatch", "TrainablePatch",
           "TRAINABLE_KINDS"]


class TrainablePatch(nn.Module, Patch):
    """Base class of the trainable interchange patches: an ``nn.Module`` whose :meth:`intervene` maps
    ``(base [..., d], source [..., d]) -> [..., d]``.

    As a patch (``pg.patch({path: patch})``, ``pg.generate`` included) it replaces ``activation[slice]`` by
    ``intervene(activation[slice], source)`` where ``source`` is :attr:`source` (``[d]``, ``[batch, d]`` for every
    selected position, or the selected shape) broadcast to that shape. With the KV cache, ``slice`` is resolved in
    each forward pass (see :mod:`gradpatch.positions`): ``Tokens([p])`` touches absolute position ``p`` once, in the
    prefill, and decode steps not at all (what it changed stays in the cache); ``(slice(None), -1)`` touches the
    last prompt token in the prefill and then each new token once.

    Args:
        width: ``d``, the width of the patched activation's last dimension (e.g. 576 for SmolLM2's residual stream).
        slice: the positions it applies to when used directly in ``pg.patch`` (as any patch's ``slice``).

    Attributes:
        source: the source activation used outside :mod:`gradpatch.interventions.interchange` (``None`` until set).
        temperature: τ of the sigmoid patches (the training loop anneals it; ignored by the rotation).

    Raises:
        SubspaceConfigError: ``width`` < 1.
    """

    requires_clone = False

    def __init__(self, width: int, slice: Slice = None) -> None:
        nn.Module.__init__(self)
        if not isinstance(width, int) or width < 1:
            raise SubspaceConfigError(f"{type(self).__name__}: width must be a positive int (the node's last "
                                      f"dimension, e.g. 576), got {width!r}")
        self.width = width
        self.slice = slice
        self.source: torch.Tensor | None = None
        self.temperature = 1.0

    __hash__ = nn.Module.__hash__  # the dataclass Patch sets __hash__ = None; modules must be hashable
    __eq__ = object.__eq__

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in self.config().items())})"

    def forward(self, original: torch.Tensor) -> torch.Tensor:
        """The patched value (``Patch.__call__``: ``op`` on ``original[slice]``)."""
        return Patch.__call__(self, original)

    def op(self, original: torch.Tensor) -> torch.Tensor:
        if self.source is None:
            raise PatchShapeError(f"{type(self).__name__} has no source activation: set patch.source to a [d] or "
                                  f"[batch, d] tensor, or train and run it through gradpatch.interventions.interchange")
        source = self.source.to(device=original.device, dtype=original.dtype)
        if source.dim() == 2 and original.dim() == 3:  # [batch, d] at every selected position
            source = source[:, None]
        try:
            source = source.expand_as(original)
        except RuntimeError as error:
            raise PatchShapeError(f"{type(self).__name__}: source of shape {tuple(self.source.shape)} does not fit the "
                                  f"patched value of shape {tuple(original.shape)}; give [d], [batch, d] or that "
                                  f"shape") from error
        return self.intervene(original, source)

    def intervene(self, base: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        """The intervened activation ``[..., d]`` from ``base`` and ``source`` (both ``[..., d]``)."""
        raise NotImplementedError

    def check_width(self, width: int, path: str) -> None:
        """Raise :class:`SubspaceConfigError` unless the node at ``path`` has last dimension :attr:`width`."""
        if width != self.width:
            raise SubspaceConfigError(f"{type(self).__name__} of width {self.width} at '{path}', whose activation has "
                                      f"last dimension {width}: build it with width={width}")

    def config(self) -> dict[str, Any]:
        """The constructor arguments other than ``slice`` (what a saved intervention records as JSON)."""
        return {"width": self.width}

    def penalty(self) -> torch.Tensor:
        """A sparsity term to add to the loss (0 for patches without one): scalar."""
        return torch.zeros(())

    def saved_state(self) -> dict[str, torch.Tensor]:
        """The tensors a saved intervention holds: the ``state_dict``, except that each orthogonally parametrized
        weight is the matrix itself (``rotation.weight``: R ``[k, d]``, what the patch computes with) instead of
        torch's parametrization internals (``rotation.parametrizations.weight.original`` and ``...weight.0.base``).
        """
        state = {name: tensor for name, tensor in self.state_dict().items() if ".parametrizations." not in name}
        for name, module in self.named_modules():
            if parametrize.is_parametrized(module, "weight"):
                state[f"{name}.weight"] = module.weight.detach()
        return state

    def load_saved_state(self, state: Mapping[str, torch.Tensor]) -> None:
        """Load :meth:`saved_state`'s tensors, or a full ``state_dict`` (the parametrization internals, as files
        before R was saved itself hold). An orthogonal weight R is rebuilt exactly: training goes on from R, with
        the parametrization's base the orthogonal completion of R and its unconstrained parameter at the point that
        maps to the base.

        Raises:
            RuntimeError: missing or unexpected names, or shapes that do not fit (as ``load_state_dict``).
        """
        if any(".parametrizations." in name for name in state):
            self.load_state_dict(dict(state))
            return
        parametrized = {f"{name}.weight": module for name, module in self.named_modules()
                        if name and parametrize.is_parametrized(module, "weight")}
        expected = self.saved_state()
        if set(state) != set(expected):
            raise RuntimeError(f"{type(self).__name__}: saved tensors {sorted(state)}, expected {sorted(expected)}")
        self.load_state_dict({name: tensor for name, tensor in state.items() if name not in parametrized},
                             strict=False)
        for name, module in parametrized.items():
            if state[name].shape != expected[name].shape:
                raise RuntimeError(f"{type(self).__name__}: {name} has shape {list(state[name].shape)}, expected "
                                   f"{list(expected[name].shape)}")
            _load_orthogonal(module, state[name])

    def stats(self) -> dict[str, float]:
        """Scalars worth logging (boundary width, mask density)."""
        return {}


def orthogonal_linear(rows: int, width: int) -> nn.Linear:
    """An ``nn.Linear(width, rows)`` whose weight ``[rows, width]`` has orthonormal rows (torch's parametrization)."""
    linear = nn.Linear(width, rows, bias=False)
    return parametrizations.orthogonal(linear)


@torch.no_grad()
def _load_orthogonal(linear: nn.Module, matrix: torch.Tensor) -> None:
    """Make ``linear``'s orthogonal parametrization (torch's, with its trivialization) give ``matrix`` ``[k, d]``
    (orthonormal rows, or columns when k > d) exactly: the base becomes ``matrix`` (transposed to tall) completed to
    an orthogonal ``[n, n]``, and the unconstrained parameter −I, which every orthogonal map sends to I (so the
    weight is the base's first columns, bit for bit)."""
    parametrization = linear.parametrizations.weight  # type: ignore[union-attr]
    tall = matrix.mT if matrix.shape[0] < matrix.shape[1] else matrix  # [n, k], n >= k
    n, k = tall.shape
    base = tall
    if n > k:
        filler = torch.randn(n, n - k, generator=torch.Generator().manual_seed(0), dtype=tall.dtype)
        completion = torch.linalg.qr(torch.cat([tall, filler.to(tall.device)], dim=-1)).Q
        base = torch.cat([tall, completion[:, k:]], dim=-1)
    parametrization[0].base.copy_(base)
    original = torch.zeros_like(parametrization.original)
    original.diagonal().fill_(-1.0)
    parametrization.original.copy_(original)


class RotatedSubspacePatch(TrainablePatch):
    """Distributed interchange intervention on a learned ``k``-dimensional subspace (DAS).

    DII(b, s) = b + Rᵀ(R s − R b), R ``[k, d]`` with orthonormal rows (Geiger et al. 2023, eq. in section 3):
    the coordinates of ``b`` in the subspace spanned by R's rows are replaced by those of ``s``; the orthogonal
    complement keeps ``b``'s. With ``k = d`` it is full interchange (the output is ``s``).

    Args:
        width: ``d``.
        dim: ``k``, the subspace size, 1 ≤ k ≤ d.
        slice: as :class:`TrainablePatch`.

    Raises:
        SubspaceConfigError: ``dim`` outside ``1..width``.
    """

    def __init__(self, width: int, dim: int, slice: Slice = None) -> None:
        super().__init__(width, slice)
        if not isinstance(dim, int) or not 1 <= dim <= width:
            raise SubspaceConfigError(f"RotatedSubspacePatch: dim={dim!r} must be an int in 1..{width} (the node's "
                                      f"width); choose a subspace no larger than the activation")
        self.dim = dim
        self.rotation = orthogonal_linear(dim, width)

    @property
    def R(self) -> torch.Tensor:  # noqa: N802 (the paper's name)
        """R ``[k, d]``, orthonormal rows."""
        return self.rotation.weight

    def intervene(self, base: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        rotation = self.R.to(base.dtype)
        return base + (source - base) @ rotation.T @ rotation

    def config(self) -> dict[str, Any]:
        return {"width": self.width, "dim": self.dim}


class BoundlessSubspacePatch(TrainablePatch):
    """Boundless DAS: a full rotation with a learned soft boundary (Wu et al. 2023, section 3).

    b + Rᵀ(m ⊙ (R s − R b)), R ``[d, d]`` orthogonal, m_i = σ((β·d − i)/τ) for i = 0 … d−1: the first ≈ β·d rotated
    coordinates are interchanged. β (:attr:`boundary`) starts at ``boundary`` and is clamped to [0, 1] in the
    forward pass; τ (:attr:`temperature`) is set by the training loop (annealed from large to small).

    Args:
        width: ``d``.
        boundary: initial β in [0, 1].
        slice: as :class:`TrainablePatch`.

    Raises:
        SubspaceConfigError: ``boundary`` outside [0, 1].
    """

    def __init__(self, width: int, boundary: float = 0.5, slice: Slice = None) -> None:
        super().__init__(width, slice)
        if not 0.0 <= float(boundary) <= 1.0:
            raise SubspaceConfigError(f"BoundlessSubspacePatch: boundary={boundary!r} must lie in [0, 1] (a fraction "
                                      f"of the width)")
        self.rotation = orthogonal_linear(width, width)
        self.boundary = nn.Parameter(torch.tensor(float(boundary)))
        self.register_buffer("index", torch.arange(width, dtype=torch.float32), persistent=False)

    @property
    def R(self) -> torch.Tensor:  # noqa: N802
        """R ``[d, d]``, orthogonal."""
        return self.rotation.weight

    def mask(self) -> torch.Tensor:
        """m ``[d]``: σ((β·d − i)/τ)."""
        beta = self.boundary.clamp(0.0, 1.0)
        return torch.sigmoid((beta * self.width - self.index) / self.temperature)

    def intervene(self, base: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        rotation = self.R.to(base.dtype)
        rotated = (source - base) @ rotation.T * self.mask().to(base.dtype)
        return base + rotated @ rotation

    def stats(self) -> dict[str, float]:
        return {"boundary_width": float(self.boundary.detach().clamp(0, 1)) * self.width}

    def config(self) -> dict[str, Any]:
        return {"width": self.width}


class SigmoidMaskPatch(TrainablePatch):
    """Per-dimension learned mask: (1 − σ(m/τ)) ⊙ b + σ(m/τ) ⊙ s, with an L1 term on σ(m/τ).

    Args:
        width: ``d``.
        init: initial mask logits ``m`` (every dimension).
        slice: as :class:`TrainablePatch`.
    """

    def __init__(self, width: int, init: float = 0.0, slice: Slice = None) -> None:
        super().__init__(width, slice)
        self.logits = nn.Parameter(torch.full((width,), float(init)))

    def mask(self) -> torch.Tensor:
        """σ(m/τ) ``[d]``."""
        return torch.sigmoid(self.logits / self.temperature)

    def intervene(self, base: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        mask = self.mask().to(base.dtype)
        return base + mask * (source - base)

    def penalty(self) -> torch.Tensor:
        """‖σ(m/τ)‖₁ (the number of dimensions interchanged, softly)."""
        return self.mask().sum()

    def stats(self) -> dict[str, float]:
        return {"mask_density": float(self.mask().detach().mean())}


class FullInterchangePatch(TrainablePatch):
    """Full-vector interchange (no parameters): the output is the source activation, DII with R = I. The exact
    computation a subspace's IIA is compared with.

    Args:
        width: ``d``.
        slice: as :class:`TrainablePatch`.
    """

    def intervene(self, base: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        return source


#: Saved kind name -> class (what :class:`~gradpatch.interventions.intervention.Intervention` loads).
TRAINABLE_KINDS: dict[str, type[TrainablePatch]] = {
    cls.__name__: cls for cls in (RotatedSubspacePatch, BoundlessSubspacePatch, SigmoidMaskPatch,
                                  FullInterchangePatch)}
