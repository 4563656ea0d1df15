"""A weight edit: a rank-one (ROME) or rank-r (MEMIT, AlphaEdit) change ``W' = W + V Uᵀ`` of one linear layer,
reversible bit for bit.

An :class:`Edit` keeps the layer's NodePath and the factors: ``u`` ``[d_in]`` and ``v`` ``[d_out]`` for ROME's rank-one
edit ``v uᵀ``, or ``U`` ``[d_in, r]`` and ``V`` ``[d_out, r]`` for a rank-r one ``V Uᵀ`` (stored in the same fields;
:mod:`editors.edits.batch` groups the per-layer edits of a many-fact edit). ``apply``
writes the new weight in place (one ``copy_`` after everything was computed and checked, so a failure leaves
the weight untouched) and keeps a copy of the original tensor; ``restore`` writes that copy back, so the
weights are bit-identical to those before ``apply``. Several edits can be stacked; restore them in reverse
order (:func:`restore_edits`). ``apply(pg, mode="patch")`` instead adds ``v uᵀ k`` to the layer's output as a patch
(:mod:`editors.edits.patches`) until ``restore``: the way to edit quantized or offloaded weights; ``as_patches``
gives the same patches for a ``with pg.patch(...)`` block.

``apply`` refuses, leaving the weights as they were: a model whose fingerprint differs from the one the edit was
computed on (unless ``check_fingerprint=False``), an edit whose value search did not converge (unless
``allow_unconverged=True``), and a second copy of an edit already applied to the same weight (a copy loaded twice
would otherwise add ``v uᵀ`` twice).

Saved as ``edit.safetensors`` (the factors) plus ``edit.json`` (NodePaths, layout, request, fingerprints,
hyperparameters, the SHA-256 of the tensors file; :mod:`editors.edits.files`) — never pickled; both files are written
atomically, the JSON last, and loading checks every field, the factors' shapes and the digest, raising
:class:`EditLoadError` naming the file.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gradpatch.model_io import wrapped_model

from ..errors import EditError, EditFingerprintError, EditLoadError, EditNotConvergedError
from ..layers import LinearLayer, resolve_layer
from ..requests import EditRequest
from .files import factor_shapes, read_edit_files, write_edit_files
from .patches import layer_patches

__all__ = ["Edit", "apply_edits", "load_edits", "read_edit_folder", "restore_edits", "save_edits"]

#: Edited module -> the edits applied to its weight and not restored (to refuse a second copy of one of them).
_APPLIED: "weakref.WeakKeyDictionary[nn.Module, list[Edit]]" = weakref.WeakKeyDictionary()
#: Edited module -> the edits applied to it as patches and not restored.
_PATCHED: "weakref.WeakKeyDictionary[nn.Module, list[Edit]]" = weakref.WeakKeyDictionary()


def _fingerprint(target: nn.Module) -> str:
    from gradpatch import model_fingerprint

    return model_fingerprint(wrapped_model(target))


@dataclass(eq=False)
class Edit:
    """One weight edit ``W' = W + v uᵀ`` (rank one) or ``W' = W + V Uᵀ`` (rank r), ``W`` in ``[d_out, d_in]``
    orientation.

    Attributes:
        node: NodePath of the edited layer, e.g. ``"model.layers_4.mlp.down_proj"``.
        u: key-side factor: ROME's ``C⁻¹k*/(k*ᵀC⁻¹k*)`` ``[d_in]``, or ``U`` ``[d_in, r]`` (float32 or float64).
        v: value-side factor: ROME's ``v* - W k*`` ``[d_out]``, or ``V`` ``[d_out, r]``.
        request: the fact this edit writes (for the record).
        model_fingerprint: fingerprint of the model the edit was computed on (checked by ``apply``).
        info: JSON-able extras: hyperparameters, losses, timings.
    """

    node: str
    u: torch.Tensor
    v: torch.Tensor
    request: EditRequest | None = None
    model_fingerprint: str | None = None
    info: dict[str, Any] = field(default_factory=dict)
    _original: torch.Tensor | None = field(default=None, repr=False)
    _applied_to: nn.Parameter | None = field(default=None, repr=False)
    _written: torch.Tensor | None = field(default=None, repr=False)
    _patch_block: Any = field(default=None, repr=False)  # the open pg.patch(...) of an edit applied as patches
    _patched_module: nn.Module | None = field(default=None, repr=False)

    @property
    def rank(self) -> int:
        """``r``: 1 for ROME's vector factors, the number of columns for matrix factors."""
        return 1 if self.u.dim() == 1 else int(self.u.shape[1])

    @property
    def applied(self) -> bool:
        """Whether the edit is currently applied (in the weight, holding the original for ``restore``, or as
        patches)."""
        return self._original is not None or self._patch_block is not None

    def as_patches(self, target: nn.Module) -> dict[str, list[Any]]:
        """The edit as patches on ``target`` (a PatchableGraph): ``{input node: key capture, output node: + v uᵀ k}``,
        for ``with pg.patch(edit.as_patches(pg)): ...``. No check is made (``apply(pg, mode="patch")`` makes them).

        Raises:
            EditLoadError: the factors do not fit the layer.
        """
        return layer_patches(self.layer(target), self.u, self.v)

    def layer(self, target: nn.Module) -> LinearLayer:
        """The edited layer in ``target`` (a PatchableGraph or the model), checked against the factor shapes.

        Raises:
            EditLoadError: ``u`` is not ``[d_in]`` / ``[d_in, r]`` or ``v`` not ``[d_out]`` / ``[d_out, r]`` for this
                layer (the same ``r`` in both).
        """
        layer = resolve_layer(target, self.node)
        if (tuple(self.u.shape), tuple(self.v.shape)) != factor_shapes(layer.d_in, layer.d_out, self.u.dim(), self.rank):
            raise EditLoadError(
                f"Edit of {self.node} has u {list(self.u.shape)} and v {list(self.v.shape)} but the layer maps "
                f"{layer.d_in} -> {layer.d_out} (u [{layer.d_in}] and v [{layer.d_out}], or u [{layer.d_in}, r] and "
                f"v [{layer.d_out}, r]): apply it to the model it was computed on"
            )
        return layer

    @torch.no_grad()
    def apply(self, target: nn.Module, check_fingerprint: bool = True, allow_unconverged: bool = False,
              mode: str = "weight") -> "Edit":
        """Add ``v uᵀ`` to the layer weight in place and keep the original weight for :meth:`restore`; with
        ``mode="patch"``, add ``v uᵀ k`` to the layer's output as a patch instead, until :meth:`restore`.

        Every check runs before the single write, so a refusal leaves the weight exactly as it was.

        Args:
            target: the PatchableGraph (or plain model, weight mode only) holding the layer.
            check_fingerprint: refuse a model whose fingerprint differs from :attr:`model_fingerprint` (the model
                the edit was computed on; a stack of edits records the model after the previous ones). ``False``
                applies the factors to any model with the layer's shape. Edits without a recorded fingerprint
                (built by hand) are not checked.
            allow_unconverged: apply an edit whose value search did not converge (``info["converged"]`` is
                ``False``: the last loss not below the first, or non-finite).
            mode: ``"weight"`` (write the weight) or ``"patch"`` (patch the output; the only way for a bitsandbytes
                or accelerate-offloaded layer, whose weight cannot be written).

        Returns:
            ``self``.

        Raises:
            EditError: the edit, or a copy of it (same factors), is already applied to this weight; or the new weight
                would hold NaN or inf.
            EditLoadError: the factors do not fit the layer.
            EditNotConvergedError: the value search did not converge and ``allow_unconverged`` is ``False``.
            EditFingerprintError: the fingerprints differ (both are named) and ``check_fingerprint`` is ``True``.
        """
        if mode not in ("weight", "patch"):
            raise ValueError(f"mode must be 'weight' or 'patch', got {mode!r}")
        if self.applied:
            raise EditError(f"The edit of {self.node} is already applied; restore() it before applying it again")
        layer = self.layer(target)
        if mode == "weight" and layer.not_writable():
            raise EditError(f"{layer.not_writable()}, so the edit cannot be written into it: apply it as a patch on "
                            f"the layer's output, edit.apply(pg, mode='patch')")
        weight = layer.weight
        patched = _PATCHED.get(layer.module, [])
        if any(other.same_factors(self) for other in [*_live_records(layer.module, weight), *patched]):
            raise EditError(
                f"An edit with the same factors is already applied to {self.node} (a second copy loaded from the same "
                f"files?); applying it again would add v uᵀ twice: restore the applied copy first"
            )
        if self.info.get("converged") is False and not allow_unconverged:
            first, last = (f"{x:.4g}" if isinstance(x, float) else x for x in (self.info.get("first_loss"),
                                                                               self.info.get("loss")))
            rewrite = self.info.get("rewrite")
            if isinstance(rewrite, dict) and rewrite.get("wins") is False:
                raise EditNotConvergedError(
                    f"The edit of {self.node} loses on its own rewrite prompt {self.request.text!r} (log P(new) "
                    f"{rewrite['logp_new']:.3g} <= log P(true) {rewrite['logp_true']:.3g}; the value search's loss "
                    f"{first} -> {last} in {self.info.get('steps')} steps), so it was not applied: edit at another "
                    f"layer (--node), give the search more room (clamp_factor, steps), or pass allow_unconverged=True "
                    f"to apply it anyway"
                )
            raise EditNotConvergedError(
                f"The value search of the edit of {self.node} did not converge (loss {first} -> {last} in "
                f"{self.info.get('steps')} steps), so it was not applied: compute it again with more steps or a "
                f"smaller learning rate, or pass allow_unconverged=True to apply it anyway"
            )
        if check_fingerprint and self.model_fingerprint is not None:
            current = _fingerprint(target)
            if current != self.model_fingerprint:
                raise EditFingerprintError(
                    f"Model fingerprint {current} differs from the edit's {self.model_fingerprint}: apply it to the "
                    f"model it was computed on (after the same earlier edits), or pass check_fingerprint=False"
                )
        if mode == "patch":
            return self._apply_as_patches(target, layer.module)
        original = weight.detach().clone()
        new = original + layer.delta_weight(self.u, self.v)
        if not torch.isfinite(new).all():
            raise EditError(f"The edit of {self.node} produces non-finite weights; it was not applied")
        weight.copy_(new)
        self._original, self._applied_to, self._written = original, weight, new
        _APPLIED.setdefault(layer.module, []).append(self)
        return self

    def _apply_as_patches(self, target: nn.Module, module: nn.Module) -> "Edit":
        if not (hasattr(target, "patch") and hasattr(target, "graph")):
            raise EditError(f"mode='patch' needs the PatchableGraph of the model, got a {type(target).__name__}")
        if not (torch.isfinite(self.u).all() and torch.isfinite(self.v).all()):
            raise EditError(f"The edit of {self.node} has non-finite factors; it was not applied")
        block = target.patch(self.as_patches(target))
        block.__enter__()
        self._patch_block, self._patched_module = block, module
        _PATCHED.setdefault(module, []).append(self)
        return self

    def same_factors(self, other: "Edit") -> bool:
        """Whether ``other`` has the same ``u`` and ``v`` values (any dtype or device)."""
        return all(a.shape == b.shape and torch.equal(a.detach().cpu().double(), b.detach().cpu().double())
                   for a, b in ((self.u, other.u), (self.v, other.v)))

    @torch.no_grad()
    def restore(self, target: nn.Module | None = None, force: bool = False) -> None:
        """Write back the exact weight seen by :meth:`apply` (bit-identical).

        Args:
            target: optional; checked to hold the weight this edit was applied to.
            force: restore even if the weight changed since ``apply`` (e.g. a later edit still applied).

        Raises:
            EditError: the edit is not applied, or the weight changed since (restore later edits first).
        """
        if self._patch_block is not None:
            block, module = self._patch_block, self._patched_module
            self._patch_block, self._patched_module = None, None
            block.__exit__(None, None, None)
            if module is not None and self in _PATCHED.get(module, []):
                _PATCHED[module].remove(self)
            return
        if self._original is None or self._applied_to is None:
            raise EditError(f"The edit of {self.node} is not applied; nothing to restore")
        weight = self._applied_to
        if target is not None and not same_tensor(resolve_layer(target, self.node).weight, weight):
            raise EditError(f"This edit was applied to another model's {self.node}; restore it on that model")
        if not force and not torch.equal(weight, self._written):
            raise EditError(
                f"The weight of {self.node} changed since this edit was applied; restore later edits first "
                f"(restore_edits restores a list in reverse order) or pass force=True"
            )
        weight.copy_(self._original)
        self._original, self._applied_to, self._written = None, None, None
        for applied in _APPLIED.values():
            if self in applied:
                applied.remove(self)

    # --- serialisation ---------------------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        """The JSON part of the saved edit (no tensors)."""
        return {
            "node": self.node,
            "d_in": int(self.u.shape[0]),
            "d_out": int(self.v.shape[0]),
            **({"rank": self.rank} if self.u.dim() == 2 else {}),
            "request": None if self.request is None else self.request.to_dict(),
            "model_fingerprint": self.model_fingerprint,
            "info": self.info,
        }

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Save to a directory: ``edit.safetensors`` + ``edit.json`` (see :func:`save_edits`)."""
        return save_edits([self], path)

    @staticmethod
    def load(path: str | os.PathLike[str]) -> "Edit":
        """Load a single edit saved with :meth:`save`.

        Raises:
            EditLoadError: the directory holds no edit or several.
        """
        edits = load_edits(path)
        if len(edits) != 1:
            raise EditLoadError(f"{path} holds {len(edits)} edits; use editors.load_edits for a list")
        return edits[0]


def _live_records(module: nn.Module, weight: torch.Tensor) -> list[Edit]:
    """The edits applied to ``weight`` (of ``module``) and not restored. Records whose edit is no longer in the weight
    — it holds exactly the value from before that edit again (restored by hand, reloaded) — are dropped."""
    records = _APPLIED.get(module, [])
    records[:] = [e for e in records if e._applied_to is not None and same_tensor(e._applied_to, weight)
                  and not torch.equal(weight, e._original)]
    return records


def same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` are the same memory: the same tensor, or views of one expert's slice of a fused MoE
    weight (:attr:`editors.layers.experts.ExpertLayer.weight` is a new view at every read)."""
    return a is b or (a.device == b.device and a.data_ptr() == b.data_ptr() and a.shape == b.shape
                      and a.stride() == b.stride())


def save_edits(edits: Sequence[Edit], path: str | os.PathLike[str], batch: dict[str, Any] | None = None) -> Path:
    """Save edits (applied in list order) to directory ``path``: ``edit.safetensors``, then ``edit.json``
    (:func:`editors.edits.files.write_edit_files`: atomic writes, the JSON last with the tensors file's SHA-256).

    Args:
        edits: the edits.
        path: the directory.
        batch: JSON-able record of the many-fact edit these per-layer edits form (``"batch"`` in ``edit.json``;
            see :class:`editors.edits.batch.BatchEdit`).

    Returns:
        The directory.

    Raises:
        NonFiniteError: a factor holds NaN or inf (nothing is written).
    """
    return write_edit_files(path, [e.to_json() for e in edits], [(e.u, e.v) for e in edits], batch)


def load_edits(path: str | os.PathLike[str]) -> list[Edit]:
    """Load edits saved with :func:`save_edits` (not applied): :func:`read_edit_folder` without the JSON.

    Raises:
        EditLoadError: as :func:`read_edit_folder`.
    """
    return read_edit_folder(path)[0]


def read_edit_folder(path: str | os.PathLike[str]) -> tuple[list[Edit], dict[str, Any], Path]:
    """The edits saved in a folder with :func:`save_edits` (not applied), its ``edit.json`` content and path.

    Raises:
        EditLoadError: as :func:`editors.edits.files.read_edit_files` (naming the file and the field).
    """
    records, meta, meta_path = read_edit_files(path)
    return [Edit(**record) for record in records], meta, meta_path


def apply_edits(target: nn.Module, edits: Sequence[Edit], check_fingerprint: bool = True,
                allow_unconverged: bool = False, mode: str = "weight") -> list[Edit]:
    """Apply edits in order (each checked as :meth:`Edit.apply` does, in ``mode`` ``"weight"`` or ``"patch"``); if
    one fails, the ones applied so far are restored and the error re-raised."""
    done: list[Edit] = []
    try:
        for edit in edits:
            done.append(edit.apply(target, check_fingerprint=check_fingerprint, allow_unconverged=allow_unconverged,
                                   mode=mode))
    except BaseException:
        restore_edits(target, done)
        raise
    return done


def restore_edits(target: nn.Module | None, edits: Sequence[Edit]) -> None:
    """Restore applied edits in reverse order (the weights end bit-identical to before the first)."""
    for edit in reversed(list(edits)):
        if edit.applied:
            edit.restore(target)
