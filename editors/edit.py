"""A ROME edit: a rank-one change ``W' = W + v uᵀ`` of one linear layer, reversible bit for bit.

An :class:`Edit` keeps the layer's NodePath and the factors ``u`` (``[d_in]``) and ``v`` (``[d_out]``). ``apply``
writes the new weight in place (one ``copy_`` after everything was computed and checked, so a failure leaves
the weight untouched) and keeps a copy of the original tensor; ``restore`` writes that copy back, so the
weights are bit-identical to those before ``apply``. Several edits can be stacked; restore them in reverse
order (:func:`restore_edits`).

Saved as ``edit.safetensors`` (the factors) plus ``edit.json`` (NodePaths, layout, request, fingerprints,
hyperparameters) — never pickled.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from .counterfact import EditRequest
from .errors import EditError, EditLoadError
from .layers import LinearLayer, resolve_layer, wrapped_model

__all__ = ["Edit", "apply_edits", "load_edits", "restore_edits", "save_edits"]

_FORMAT = "gradpatch.rome-edit"
_VERSION = 1


def _fingerprint(target: nn.Module) -> str:
    from gradpatch import model_fingerprint

    return model_fingerprint(wrapped_model(target))


@dataclass(eq=False)
class Edit:
    """One rank-one weight edit ``W' = W + v uᵀ`` (``W`` in ``[d_out, d_in]`` orientation).

    Attributes:
        node: NodePath of the edited layer, e.g. ``"model.layers_4.mlp.down_proj"``.
        u: key-side factor ``C⁻¹k*/(k*ᵀC⁻¹k*)``, ``[d_in]`` (float32 or float64).
        v: value-side factor ``v* - W k*``, ``[d_out]``.
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

    @property
    def applied(self) -> bool:
        """Whether the edit is currently applied (and holds the original weight for ``restore``)."""
        return self._original is not None

    def layer(self, target: nn.Module) -> LinearLayer:
        """The edited layer in ``target`` (a PatchableGraph or the model), checked against the factor sizes.

        Raises:
            EditLoadError: the layer's shape does not match ``u``/``v``.
        """
        layer = resolve_layer(target, self.node)
        if (layer.d_in, layer.d_out) != (self.u.numel(), self.v.numel()):
            raise EditLoadError(
                f"Edit of {self.node} has u [{self.u.numel()}] and v [{self.v.numel()}] but the layer maps "
                f"{layer.d_in} -> {layer.d_out}: apply it to the model it was computed on"
            )
        return layer

    @torch.no_grad()
    def apply(self, target: nn.Module, check_fingerprint: bool = False) -> "Edit":
        """Add ``v uᵀ`` to the layer weight in place and keep the original weight for :meth:`restore`.

        Args:
            target: the PatchableGraph (or plain model) holding the layer.
            check_fingerprint: raise if the model's fingerprint differs from :attr:`model_fingerprint`
                (the model the edit was computed on; a stack of edits records the model after the previous ones).

        Returns:
            ``self``.

        Raises:
            EditError: the edit is already applied.
            EditLoadError: wrong layer shape or fingerprint.
        """
        if self.applied:
            raise EditError(f"The edit of {self.node} is already applied; restore() it before applying it again")
        layer = self.layer(target)
        if check_fingerprint and self.model_fingerprint is not None:
            current = _fingerprint(target)
            if current != self.model_fingerprint:
                raise EditLoadError(
                    f"Model fingerprint {current} differs from the edit's {self.model_fingerprint}: apply it to the "
                    f"model it was computed on (after the same earlier edits), or pass check_fingerprint=False"
                )
        weight = layer.weight
        original = weight.detach().clone()
        new = original + layer.delta_weight(self.u, self.v)
        if not torch.isfinite(new).all():
            raise EditError(f"The edit of {self.node} produces non-finite weights; it was not applied")
        weight.copy_(new)
        self._original, self._applied_to, self._written = original, weight, new
        return self

    @torch.no_grad()
    def restore(self, target: nn.Module | None = None, force: bool = False) -> None:
        """Write back the exact weight seen by :meth:`apply` (bit-identical).

        Args:
            target: optional; checked to hold the weight this edit was applied to.
            force: restore even if the weight changed since ``apply`` (e.g. a later edit still applied).

        Raises:
            EditError: the edit is not applied, or the weight changed since (restore later edits first).
        """
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

    # --- serialisation ---------------------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        """The JSON part of the saved edit (no tensors)."""
        return {
            "node": self.node,
            "d_in": int(self.u.numel()),
            "d_out": int(self.v.numel()),
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


def save_edits(edits: Sequence[Edit], path: str | os.PathLike[str]) -> Path:
    """Save edits (applied in list order) to directory ``path``: ``edit.safetensors`` and ``edit.json``.

    Returns:
        The directory.
    """
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for i, edit in enumerate(edits):
        tensors[f"{i}.u"] = edit.u.detach().cpu().contiguous()
        tensors[f"{i}.v"] = edit.v.detach().cpu().contiguous()
    save_file(tensors, str(folder / "edit.safetensors"), metadata={"format": _FORMAT})
    meta = {"format": _FORMAT, "version": _VERSION, "edits": [e.to_json() for e in edits]}
    (folder / "edit.json").write_text(json.dumps(meta, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    return folder


def load_edits(path: str | os.PathLike[str]) -> list[Edit]:
    """Load edits saved with :func:`save_edits` (not applied).

    Raises:
        EditLoadError: missing files, another format, or tensors missing.
    """
    folder = Path(path)
    meta_path, tensor_path = folder / "edit.json", folder / "edit.safetensors"
    if not meta_path.is_file() or not tensor_path.is_file():
        raise EditLoadError(f"{folder} has no edit.json/edit.safetensors; save edits with Edit.save or save_edits")
    meta = json.loads(meta_path.read_text(encoding="utf-8"))
    if meta.get("format") != _FORMAT:
        raise EditLoadError(f"{meta_path} is not a gradpatch ROME edit (format {meta.get('format')!r})")
    tensors = load_file(str(tensor_path))
    edits = []
    for i, record in enumerate(meta["edits"]):
        try:
            u, v = tensors[f"{i}.u"], tensors[f"{i}.v"]
        except KeyError as exc:
            raise EditLoadError(f"{tensor_path} lacks tensor {exc}; the files do not belong together") from None
        if (u.numel(), v.numel()) != (record["d_in"], record["d_out"]):
            raise EditLoadError(f"Edit {i} in {folder}: factor sizes disagree with edit.json")
        request = None if record.get("request") is None else EditRequest.from_dict(record["request"])
        edits.append(
            Edit(node=record["node"], u=u, v=v, request=request,
                 model_fingerprint=record.get("model_fingerprint"), info=record.get("info", {}))
        )
    return edits


def apply_edits(target: nn.Module, edits: Sequence[Edit], check_fingerprint: bool = False) -> list[Edit]:
    """Apply edits in order; if one fails, the ones applied so far are restored and the error re-raised."""
    done: list[Edit] = []
    try:
        for edit in edits:
            done.append(edit.apply(target, check_fingerprint=check_fingerprint))
    except BaseException:
        restore_edits(target, done)
        raise
    return done


def restore_edits(target: nn.Module | None, edits: Sequence[Edit]) -> None:
    """Restore applied edits in reverse order (the weights end bit-identical to before the first)."""
    for edit in reversed(list(edits)):
        if edit.applied:
            edit.restore(target)
