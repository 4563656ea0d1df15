"""Saved ROME edits: fingerprints checked by default, no stacking of a second copy, convergence, damaged files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save as save_safetensors
from torch import nn

from editors import Edit, EditRequest, load_edits, resolve_layer, save_edits
from editors.errors import EditError, EditFingerprintError, EditLoadError, EditNotConvergedError
from gradpatch import PatchableGraph, model_fingerprint
from gradpatch.errors import FingerprintMismatchError, NonFiniteError
from gradpatch.files.atomic import sha256_hex


class Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(64, 8), nn.Linear(8, 8)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers[1](torch.tanh(self.layers[0](x)))


def _toy(seed: int) -> Toy:
    torch.manual_seed(seed)
    return Toy().eval()


def _edit(model: nn.Module | None, seed: int = 0, **info) -> Edit:
    g = torch.Generator().manual_seed(seed)
    return Edit(node="layers_0", u=torch.randn(64, generator=g, dtype=torch.float64),
                v=torch.randn(8, generator=g, dtype=torch.float64),
                request=EditRequest(prompt="The capital of {} is", subject="France", target_new="London"),
                model_fingerprint=None if model is None else model_fingerprint(model), info=dict(info))


def test_a_loaded_edit_refuses_another_model_by_default(tmp_path) -> None:
    computed_on, other = _toy(0), _toy(1)
    _edit(computed_on).save(tmp_path / "e")
    original = other.layers[0].weight.detach().clone()
    with pytest.raises(EditFingerprintError) as info:
        Edit.load(tmp_path / "e").apply(other)
    message = str(info.value)
    assert model_fingerprint(computed_on) in message and model_fingerprint(other) in message
    assert "check_fingerprint=False" in message
    assert isinstance(info.value, FingerprintMismatchError) and isinstance(info.value, EditLoadError)
    assert torch.equal(other.layers[0].weight, original)
    edit = Edit.load(tmp_path / "e").apply(other, check_fingerprint=False)  # the explicit opt-out
    assert not torch.equal(other.layers[0].weight, original)
    edit.restore(other)
    assert torch.equal(other.layers[0].weight, original)


def test_a_second_loaded_copy_does_not_stack(tmp_path) -> None:
    model = _toy(0)
    pg = PatchableGraph(model, torch.randn(2, 64))
    _edit(model).save(tmp_path / "e")
    original = model.layers[0].weight.detach().clone()
    Edit.load(tmp_path / "e").apply(pg)  # applied, and the returned edit not even kept
    edited = model.layers[0].weight.detach().clone()
    for target in (pg, model):  # through the graph or on the plain model: the same weight
        for check in (True, False):
            with pytest.raises(EditError, match="same factors is already applied"):
                Edit.load(tmp_path / "e").apply(target, check_fingerprint=check)
    assert torch.equal(model.layers[0].weight, edited)
    other = _edit(None, seed=1).apply(model)  # a different edit of the same layer still stacks
    other.restore(model)
    assert torch.equal(model.layers[0].weight, edited)
    first = Edit.load(tmp_path / "e")
    with torch.no_grad():
        model.layers[0].weight.copy_(original)  # weights restored by hand: the record is of the old copy's weight
    first.apply(pg)
    with pytest.raises(EditError, match="same factors"):
        Edit.load(tmp_path / "e").apply(pg, check_fingerprint=False)
    first.restore(pg)
    again = Edit.load(tmp_path / "e").apply(pg)  # once restored, a copy may be applied
    again.restore(pg)
    assert torch.equal(model.layers[0].weight, original)


def test_an_unconverged_edit_is_not_applied_unless_asked(tmp_path) -> None:
    model = _toy(0)
    original = model.layers[0].weight.detach().clone()
    save_edits([_edit(model, converged=False, first_loss=3.0, loss=7.5, steps=25)], tmp_path / "e")
    edit = Edit.load(tmp_path / "e")
    with pytest.raises(EditNotConvergedError, match=r"3 -> 7.5 in 25 steps.*allow_unconverged=True"):
        edit.apply(model)
    assert torch.equal(model.layers[0].weight, original) and not edit.applied
    edit.apply(model, allow_unconverged=True)
    assert not torch.equal(model.layers[0].weight, original)
    edit.restore(model)


def test_non_finite_factors_are_not_saved(tmp_path) -> None:
    edit = _edit(None)
    edit.v[3] = float("inf")
    with pytest.raises(NonFiniteError, match="0.v"):
        edit.save(tmp_path / "e")
    assert not (tmp_path / "e").exists()


def test_empty_nodepath_components_are_rejected() -> None:
    with pytest.raises(KeyError, match="empty component"):
        resolve_layer(_toy(0), "layers..0")


def _rewrite(folder: Path, change) -> None:
    document = json.loads((folder / "edit.json").read_text())
    change(document)
    (folder / "edit.json").write_text(json.dumps(document))


def _replace_tensors(folder: Path, tensors: dict[str, torch.Tensor]) -> None:
    data = save_safetensors(tensors)
    (folder / "edit.safetensors").write_bytes(data)
    _rewrite(folder, lambda d: d.update(tensors_sha256=sha256_hex(data)))


def _interrupted_save(folder: Path) -> None:
    """Tensors from a later save, JSON from the earlier one: what a crash between the two renames leaves."""
    later = folder.parent / "later"
    save_edits([_edit(None, seed=5)], later)
    (folder / "edit.safetensors").write_bytes((later / "edit.safetensors").read_bytes())


DAMAGES = {
    "truncated tensors": (lambda f: (f / "edit.safetensors").write_bytes((f / "edit.safetensors").read_bytes()[:50]),
                          "edit.safetensors"),
    "garbage tensors, no digest": (lambda f: [(f / "edit.safetensors").write_bytes(b"garbage" * 20),
                                              _rewrite(f, lambda d: d.pop("tensors_sha256"))],
                                   "not a readable safetensors file"),
    "interrupted save": (_interrupted_save, "different saves"),
    "corrupt json": (lambda f: (f / "edit.json").write_text('{"format": "gradpatch.rome-edit", "edi'), "edit.json"),
    "json without d_in": (lambda f: _rewrite(f, lambda d: d["edits"][0].pop("d_in")), "lacks ['d_in']"),
    "d_in a string": (lambda f: _rewrite(f, lambda d: d["edits"][0].update(d_in="64")), "positive integers"),
    "edits not a list": (lambda f: _rewrite(f, lambda d: d.update(edits={})), "'edits' list"),
    "empty component": (lambda f: _rewrite(f, lambda d: d["edits"][0].update(node="layers..0")), "non-empty"),
    "bad request": (lambda f: _rewrite(f, lambda d: d["edits"][0].update(request={"prompt": "x"})), "request"),
    "wrong rank": (lambda f: _replace_tensors(f, {"0.u": torch.zeros(8, 8), "0.v": torch.zeros(8)}),
                   "'0.u' has shape [8, 8]"),
    "missing factor": (lambda f: _replace_tensors(f, {"0.u": torch.zeros(64)}), "lacks tensor '0.v'"),
    "nan factor": (lambda f: _replace_tensors(f, {"0.u": torch.full((64,), float("nan")), "0.v": torch.zeros(8)}),
                   "NaN"),
    "newer version": (lambda f: _rewrite(f, lambda d: d.update(version=99)), "upgrade gradpatch"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_damaged_edit_files_raise_edit_load_error(damage: str, tmp_path) -> None:
    folder = _edit(_toy(0)).save(tmp_path / "e")
    change, expected = DAMAGES[damage]
    change(folder)
    with pytest.raises(EditLoadError) as info:
        load_edits(folder)
    assert expected in str(info.value) and str(folder) in str(info.value)


def test_factor_shapes_are_checked_at_apply() -> None:
    flat = Edit(node="layers_0", u=torch.zeros(8, 8), v=torch.zeros(8))  # 64 elements, but not [64]
    with pytest.raises(EditLoadError, match=r"u \[8, 8\]"):
        flat.apply(_toy(0))
