"""A weight edit: a rank-one (ROME) or rank-r (MEMIT, AlphaEdit) change ``W' = W + V Uᵀ`` of one linear layer,
reversible bit for bit.

An :class:`Edit` keeps the layer's NodePath and the factors: ``u`` ``[d_in]`` and ``v`` ``[d_out]`` for ROME's rank-one
edit ``v uᵀ``, or ``U`` ``[d_in, r]`` and ``V`` ``[d_out, r]`` for a rank-r one ``V Uᵀ`` (stored in the same fields;
:mod:`editors.edit_batch` groups the per-layer edits of a many-fact edit). ``apply``
writes the new weight in place (one ``copy_`` after everything was computed and checked, so a failure leaves
the weight untouched) and keeps a copy of the original tensor; ``restore`` writes that copy back, so the
weights are bit-identical to those before ``apply``. Several edits can be stacked; restore them in reverse
order (:func:`restore_edits`). ``apply(pg, mode="patch")`` instead adds ``v uᵀ k`` to the layer's output as a patch
(:mod:`editors.edit_patch`) until ``restore``: the way to edit quantized or offloaded weights; ``as_patches``
gives the same patches for a ``with pg.patch(...)`` block.

``apply`` refuses, leaving the weights as they were: a model whose fingerprint differs from the one the edit was
computed on (unless ``check_fingerprint=False``), an edit whose value search did not converge (unless
``allow_unconverged=True``), and a second copy of an edit already applied to the same weight (a copy loaded twice
would otherwise add ``v uᵀ`` twice).

Saved as ``edit.safetensors`` (the factors) plus ``edit.json`` (NodePaths, layout, request, fingerprints,
hyperparameters, the SHA-256 of the tensors file) — never pickled; both files are written atomically, the JSON last,
and loading checks every field, the factors' shapes and the digest, raising :class:`EditLoadError` naming the file.
"""

from __future__ import annotations

import json
import os
import re
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save as save_safetensors
from torch import nn

from gradpatch.files import atomic_write_bytes, atomic_write_text, read_json, read_tensors, sha256_hex
from gradpatch.finite import check_finite

from .counterfact import EditRequest
from .edit_patch import low_rank_patches
from .errors import EditError, EditFingerprintError, EditLoadError, EditNotConvergedError
from .layers import LinearLayer, resolve_layer, wrapped_model

__all__ = ["Edit", "apply_edits", "load_edits", "read_edit_folder", "restore_edits", "save_edits"]

_FORMAT = "gradpatch.rome-edit"
#: 2: the SHA-256 of edit.safetensors in edit.json; 3: rank-r factors (``"rank"`` in a record). Older files still
#: load.
_VERSION = 3
_LOAD_FIX = "save the edits again with Edit.save or editors.save_edits"

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
        layer = self.layer(target)
        return low_rank_patches(layer.input_node, layer.output_node, self.u, self.v)

    def layer(self, target: nn.Module) -> LinearLayer:
        """The edited layer in ``target`` (a PatchableGraph or the model), checked against the factor shapes.

        Raises:
            EditLoadError: ``u`` is not ``[d_in]`` / ``[d_in, r]`` or ``v`` not ``[d_out]`` / ``[d_out, r]`` for this
                layer (the same ``r`` in both).
        """
        layer = resolve_layer(target, self.node)
        if (tuple(self.u.shape), tuple(self.v.shape)) != _factor_shapes(layer.d_in, layer.d_out, self.u.dim(), self.rank):
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
        if target is not None and resolve_layer(target, self.node).weight is not weight:
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


def _factor_shapes(d_in: int, d_out: int, dims: int, rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The shapes of ``(u, v)``: ``([d_in], [d_out])`` for vector factors, ``([d_in, r], [d_out, r])`` for matrices."""
    return ((d_in,), (d_out,)) if dims == 1 else ((d_in, rank), (d_out, rank))


def _live_records(module: nn.Module, weight: torch.Tensor) -> list[Edit]:
    """The edits applied to ``weight`` (of ``module``) and not restored. Records whose edit is no longer in the weight
    — it holds exactly the value from before that edit again (restored by hand, reloaded) — are dropped."""
    records = _APPLIED.get(module, [])
    records[:] = [e for e in records if e._applied_to is weight and not torch.equal(weight, e._original)]
    return records


def save_edits(edits: Sequence[Edit], path: str | os.PathLike[str], batch: dict[str, Any] | None = None) -> Path:
    """Save edits (applied in list order) to directory ``path``: ``edit.safetensors``, then ``edit.json``.

    Each file is written atomically (temporary file + rename), the JSON last and recording the tensors file's
    SHA-256, so a crash never leaves a pair that loads as something else.

    Args:
        edits: the edits.
        path: the directory.
        batch: JSON-able record of the many-fact edit these per-layer edits form (``"batch"`` in ``edit.json``;
            see :class:`editors.edit_batch.BatchEdit`).

    Returns:
        The directory.

    Raises:
        NonFiniteError: a factor holds NaN or inf (nothing is written).
    """
    folder = Path(path)
    tensors: dict[str, torch.Tensor] = {}
    for i, edit in enumerate(edits):
        tensors[f"{i}.u"] = edit.u.detach().cpu().contiguous()
        tensors[f"{i}.v"] = edit.v.detach().cpu().contiguous()
    check_finite(tensors, "edit factors", "nothing was saved: recompute the edit")
    data = save_safetensors(tensors, metadata={"format": _FORMAT})
    meta = {"format": _FORMAT, "version": _VERSION, "edits": [e.to_json() for e in edits],
            **({"batch": batch} if batch is not None else {}), "tensors_sha256": sha256_hex(data)}
    atomic_write_bytes(folder / "edit.safetensors", data)
    atomic_write_text(folder / "edit.json", json.dumps(meta, indent=1, ensure_ascii=False) + "\n")
    return folder


def load_edits(path: str | os.PathLike[str]) -> list[Edit]:
    """Load edits saved with :func:`save_edits` (not applied): :func:`read_edit_folder` without the JSON.

    Raises:
        EditLoadError: as :func:`read_edit_folder`.
    """
    return read_edit_folder(path)[0]


def read_edit_folder(path: str | os.PathLike[str]) -> tuple[list[Edit], dict[str, Any], Path]:
    """The edits saved in a folder with :func:`save_edits` (not applied), its ``edit.json`` content and path.

    Raises:
        EditLoadError: missing files; an unreadable, garbled or incomplete ``edit.json`` (a missing ``d_in``, say);
            another format or a newer version; an unreadable ``edit.safetensors`` or one from another save; a factor
            missing, non-finite or of another shape than ``[d_in]`` / ``[d_out]``. The message names the file.
    """
    folder = Path(path)
    meta_path, tensor_path = folder / "edit.json", folder / "edit.safetensors"
    if not meta_path.is_file() or not tensor_path.is_file():
        raise EditLoadError(f"{folder} has no edit.json/edit.safetensors; save edits with Edit.save or save_edits")
    meta = read_json(meta_path, EditLoadError, _LOAD_FIX)
    if meta.get("format") != _FORMAT:
        raise EditLoadError(f"{meta_path} is not a gradpatch ROME edit (format {meta.get('format')!r})")
    if not isinstance(meta.get("version"), int) or meta["version"] > _VERSION:
        raise EditLoadError(f"{meta_path} has version {meta.get('version')!r}; this gradpatch reads versions <= "
                            f"{_VERSION}: upgrade gradpatch or {_LOAD_FIX}")
    records = meta.get("edits")
    if not isinstance(records, list):
        raise EditLoadError(f"{meta_path} has no 'edits' list; {_LOAD_FIX}")
    tensors = read_tensors(tensor_path, EditLoadError, _LOAD_FIX, meta.get("tensors_sha256"))
    edits = [_edit_from_record(i, record, tensors, meta_path, tensor_path) for i, record in enumerate(records)]
    return edits, meta, meta_path


def _edit_from_record(i: int, record: Any, tensors: dict[str, torch.Tensor], meta_path: Path,
                      tensor_path: Path) -> Edit:
    """Edit ``i`` of a loaded file, every field and both factors checked.

    Raises:
        EditLoadError: naming the file and the field.
    """
    where = f"{meta_path}, edit {i}"
    if not isinstance(record, dict):
        raise EditLoadError(f"{where} is a {type(record).__name__}, not an object; {_LOAD_FIX}")
    missing = sorted({"node", "d_in", "d_out"} - set(record))
    if missing:
        raise EditLoadError(f"{where} lacks {missing}; {_LOAD_FIX}")
    node, sizes = record["node"], (record["d_in"], record["d_out"])
    if not isinstance(node, str) or "" in re.split(r"[.|]", node):
        raise EditLoadError(f"{where}: node {node!r} is not a NodePath of non-empty names; {_LOAD_FIX}")
    if not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in sizes):
        raise EditLoadError(f"{where}: d_in and d_out must be positive integers, got {sizes}; {_LOAD_FIX}")
    fingerprint, info = record.get("model_fingerprint"), record.get("info", {})
    if not (fingerprint is None or isinstance(fingerprint, str)) or not isinstance(info, dict):
        raise EditLoadError(f"{where}: model_fingerprint must be a string or null and info an object; {_LOAD_FIX}")
    factors = []
    rank = record.get("rank")
    if rank is not None and not (isinstance(rank, int) and not isinstance(rank, bool) and rank > 0):
        raise EditLoadError(f"{where}: rank must be a positive integer, got {rank!r}; {_LOAD_FIX}")
    shapes = _factor_shapes(sizes[0], sizes[1], 1 if rank is None else 2, rank or 1)
    for name, shape in zip(("u", "v"), shapes):
        key = f"{i}.{name}"
        if key not in tensors:
            raise EditLoadError(f"{tensor_path} lacks tensor {key!r}; the files do not belong together: {_LOAD_FIX}")
        factor = tensors[key]
        if tuple(factor.shape) != shape:
            raise EditLoadError(f"{tensor_path}: {key!r} has shape {list(factor.shape)}, but edit.json says "
                                f"{list(shape)}; {_LOAD_FIX}")
        if not bool(torch.isfinite(factor).all()):
            raise EditLoadError(f"{tensor_path}: {key!r} holds NaN or inf; {_LOAD_FIX}")
        factors.append(factor)
    try:
        request = None if record.get("request") is None else EditRequest.from_dict(record["request"])
    except (ValueError, TypeError, AttributeError) as exc:
        raise EditLoadError(f"{where}: the request is invalid ({exc}); {_LOAD_FIX}") from exc
    return Edit(node=node, u=factors[0], v=factors[1], request=request, model_fingerprint=fingerprint, info=info)


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
