"""A many-fact edit (MEMIT, AlphaEdit): one low-rank weight change per edited layer, applied, restored and saved as
one.

MEMIT (arXiv 2210.07229, eq. 14) writes ``F`` facts into each of its layers with ``ΔW = R Kᵀ (λC + K Kᵀ)⁻¹``, a
matrix of rank at most ``F``; it is kept as the factors ``V = R`` ``[d_out, F]`` and ``U = (λC + K Kᵀ)⁻¹ K``
``[d_in, F]`` (``ΔW = V Uᵀ``), one :class:`editors.edits.edit.Edit` of rank ``F`` per layer. Factors rather than the
dense ``ΔW`` because they are what the algorithm computes (nothing is re-derived), they are ROME's ``u``/``v`` with a
second dimension (a rank-one edit is the ``F = 1`` case; the same file format, loader checks and patches serve both),
the patch form costs ``(d_in + d_out) · F`` per token instead of reading a dense matrix, and for the batch sizes edits
are made in (up to a few hundred facts per layer of SmolLM2's ``1536 -> 576`` down_proj) they are no larger than
``ΔW``; a 1,000-fact edit stores 2.1M numbers per layer against 0.9M for ``ΔW`` (17 MB in float64).

:class:`BatchEdit` holds the per-layer edits, the requests, the fingerprint of the model it was computed on and the
run's record. ``apply`` checks everything first (fingerprint once, for the whole edit; convergence; every layer's
factor shapes and writability) and writes the layers in order, restoring those already written if one fails;
``restore`` writes every original weight back (bit-identical); ``mode="patch"`` adds ``V Uᵀ k`` at each layer's
output instead (quantized or offloaded weights). Saved as one ``edit.safetensors`` + ``edit.json`` pair (the
per-layer records plus a ``"batch"`` object with the requests), written atomically and checked on load like a ROME
edit; :func:`editors.load_edits` reads the same folder as the list of per-layer edits.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import nn

from gradpatch import model_fingerprint
from gradpatch.model_io import wrapped_model

from ..errors import EditError, EditFingerprintError, EditLoadError, EditNotConvergedError
from ..requests import EditRequest
from .edit import Edit, apply_edits, read_edit_folder, restore_edits, save_edits

__all__ = ["BatchEdit"]

_LOAD_FIX = "save the edit again with BatchEdit.save"


@dataclass(eq=False)
class BatchEdit:
    """Many facts written into one or more linear layers: one rank-``F`` :class:`Edit` per layer.

    Attributes:
        edits: per-layer edits in forward order, each ``W' = W + V Uᵀ`` with ``U`` ``[d_in, F]``, ``V`` ``[d_out, F]``
            (their own fingerprints are ``None``: the batch's is checked once).
        requests: the ``F`` facts.
        model_fingerprint: fingerprint of the model the edit was computed on (checked by :meth:`apply`).
        info: JSON-able record: method, hyperparameters, per-fact value search results (``"facts"``), timings;
            ``info["converged"]`` is ``False`` when a fact's value search did not converge.
    """

    edits: list[Edit]
    requests: list[EditRequest]
    model_fingerprint: str | None = None
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def nodes(self) -> list[str]:
        """NodePaths of the edited layers."""
        return [edit.node for edit in self.edits]

    @property
    def applied(self) -> bool:
        """Whether the edit is applied (to any of its layers)."""
        return any(edit.applied for edit in self.edits)

    def apply(self, target: nn.Module, check_fingerprint: bool = True, allow_unconverged: bool = False,
              mode: str = "weight") -> "BatchEdit":
        """Write every layer's change (``mode="weight"``) or add it as patches (``mode="patch"``).

        All checks run before the first write; if a later layer's write fails, the layers already written are
        restored, so the weights end as they were.

        Args:
            target: the PatchableGraph (or plain model, weight mode only).
            check_fingerprint: refuse a model whose fingerprint differs from :attr:`model_fingerprint`.
            allow_unconverged: apply even if a fact's value search did not converge.
            mode: ``"weight"`` or ``"patch"`` (see :meth:`editors.edits.edit.Edit.apply`).

        Returns:
            ``self``.

        Raises:
            EditError: already applied; a layer's factors or weight refuse (see :meth:`Edit.apply`).
            EditNotConvergedError: a fact's value search did not converge (the facts are named).
            EditFingerprintError: the fingerprints differ.
        """
        if self.applied:
            raise EditError(f"This {len(self.requests)}-fact edit of {self.nodes} is already applied; restore() it "
                            f"before applying it again")
        if self.info.get("converged") is False and not allow_unconverged:
            unconverged = [f["subject"] for f in self.info.get("facts", []) if f.get("converged") is False]
            raise EditNotConvergedError(
                f"The value search of {len(unconverged)} of {len(self.requests)} facts did not converge "
                f"({', '.join(repr(s) for s in unconverged[:5])}{', ...' if len(unconverged) > 5 else ''}), so the "
                f"edit was not applied: compute it with more steps, or pass allow_unconverged=True")
        if check_fingerprint and self.model_fingerprint is not None:
            current = model_fingerprint(wrapped_model(target))
            if current != self.model_fingerprint:
                raise EditFingerprintError(
                    f"Model fingerprint {current} differs from the edit's {self.model_fingerprint}: apply it to the "
                    f"model it was computed on (after the same earlier edits), or pass check_fingerprint=False")
        for edit in self.edits:
            edit.layer(target)  # every layer's factor shapes, before anything is written
        apply_edits(target, self.edits, check_fingerprint=False, allow_unconverged=True, mode=mode)
        return self

    def restore(self, target: nn.Module | None = None) -> None:
        """Undo every layer (in reverse order): the weights are bit-identical to those before :meth:`apply`.

        Raises:
            EditError: the edit is not applied, or a weight changed since (restore later edits first).
        """
        if not self.applied:
            raise EditError(f"This {len(self.requests)}-fact edit of {self.nodes} is not applied; nothing to restore")
        restore_edits(target, self.edits)

    def as_patches(self, target: nn.Module) -> dict[str, list[Any]]:
        """Every layer's change as patches, for ``with pg.patch(batch.as_patches(pg)): ...``.

        Raises:
            EditLoadError: a layer's factors do not fit the graph.
        """
        patches: dict[str, list[Any]] = {}
        for edit in self.edits:
            for node, items in edit.as_patches(target).items():
                patches.setdefault(node, []).extend(items)
        return patches

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Save to a directory: ``edit.safetensors`` + ``edit.json`` (atomic writes, the JSON last).

        Raises:
            NonFiniteError: a factor holds NaN or inf (nothing is written).
        """
        batch = {"requests": [r.to_dict() for r in self.requests], "model_fingerprint": self.model_fingerprint,
                 "info": self.info}
        return save_edits(self.edits, path, batch=batch)

    @staticmethod
    def load(path: str | os.PathLike[str]) -> "BatchEdit":
        """Load an edit saved with :meth:`save` (not applied).

        Raises:
            EditLoadError: the files are missing or damaged (see :func:`editors.load_edits`), hold no ``"batch"``
                record (a ROME edit: use :func:`editors.load_edits`), or the record is malformed; the message names
                the file.
        """
        edits, meta, meta_path = read_edit_folder(path)
        batch = meta.get("batch")
        if not isinstance(batch, dict):
            raise EditLoadError(f"{meta_path} holds per-layer edits but no many-fact 'batch' record; load it with "
                                f"editors.load_edits, or {_LOAD_FIX}")
        requests, fingerprint, info = batch.get("requests"), batch.get("model_fingerprint"), batch.get("info", {})
        if not isinstance(requests, list) or not requests:
            raise EditLoadError(f"{meta_path}: 'batch.requests' must be a non-empty list; {_LOAD_FIX}")
        if not (fingerprint is None or isinstance(fingerprint, str)) or not isinstance(info, dict):
            raise EditLoadError(f"{meta_path}: 'batch.model_fingerprint' must be a string or null and 'batch.info' an "
                                f"object; {_LOAD_FIX}")
        ranks = {edit.rank for edit in edits}
        if not edits or ranks != {len(requests)}:
            raise EditLoadError(f"{meta_path}: {len(requests)} requests but per-layer edits of rank {sorted(ranks)}; "
                                f"{_LOAD_FIX}")
        try:
            parsed = [EditRequest.from_dict(r) for r in requests]
        except (ValueError, TypeError, AttributeError) as exc:
            raise EditLoadError(f"{meta_path}: a request in 'batch.requests' is invalid ({exc}); {_LOAD_FIX}") from exc
        return BatchEdit(edits=edits, requests=parsed, model_fingerprint=fingerprint, info=info)
