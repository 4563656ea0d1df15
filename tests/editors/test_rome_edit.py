"""Edit objects: in-place apply, bit-exact restore, stacking, safetensors + JSON round trip, failure safety."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from editors import Edit, EditRequest, apply_edits, load_edits, restore_edits, save_edits
from editors.errors import EditError, EditLoadError


class Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(8, 5), nn.Linear(5, 5)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers[1](torch.tanh(self.layers[0](x)))


def _edit(seed: int, node: str = "layers_0", d_in: int = 8, d_out: int = 5) -> Edit:
    g = torch.Generator().manual_seed(seed)
    return Edit(node=node, u=torch.randn(d_in, generator=g, dtype=torch.float64),
                v=torch.randn(d_out, generator=g, dtype=torch.float64),
                request=EditRequest(prompt="The capital of {} is", subject="France", target_new="London",
                                    target_true="Paris"))


@pytest.fixture
def toy() -> Toy:
    torch.manual_seed(0)
    return Toy().eval()


def test_restore_is_bit_exact(toy: Toy) -> None:
    original = toy.layers[0].weight.detach().clone()
    edit = _edit(0).apply(toy)  # NodePath "layers_0" resolves on a plain model too
    assert edit.applied
    assert not torch.equal(toy.layers[0].weight, original)
    assert torch.allclose(toy.layers[0].weight - original, torch.outer(edit.v, edit.u).float(), atol=1e-6)
    edit.restore(toy)
    assert torch.equal(toy.layers[0].weight, original)
    assert not edit.applied


def test_restore_on_patchable_graph(toy: Toy) -> None:
    from gradpatch import PatchableGraph

    pg = PatchableGraph(toy, torch.randn(2, 8))
    x = torch.randn(3, 8)
    before = pg(x).detach().clone()
    original = toy.layers[0].weight.detach().clone()
    edit = _edit(1).apply(pg)
    assert not torch.equal(pg(x), before)
    edit.restore(pg)
    assert torch.equal(toy.layers[0].weight, original)
    assert torch.equal(pg(x), before)


def test_stacked_edits_restore_in_reverse_order(toy: Toy) -> None:
    w0 = toy.layers[0].weight.detach().clone()
    w1 = toy.layers[1].weight.detach().clone()
    edits = apply_edits(toy, [_edit(2), _edit(3), _edit(4, node="layers_1", d_in=5)])
    with pytest.raises(EditError, match="restore later edits first"):
        edits[0].restore(toy)  # the second edit of the same layer is still applied
    assert edits[0].applied
    restore_edits(toy, edits)
    assert torch.equal(toy.layers[0].weight, w0) and torch.equal(toy.layers[1].weight, w1)


def test_failed_apply_leaves_weights_untouched(toy: Toy) -> None:
    original = toy.layers[0].weight.detach().clone()
    bad = _edit(5)
    bad.u[0] = float("nan")
    with pytest.raises(EditError, match="non-finite"):
        bad.apply(toy)
    assert torch.equal(toy.layers[0].weight, original)
    wrong_shape = _edit(6, d_in=7)
    with pytest.raises(EditLoadError, match="maps 8 -> 5"):
        wrong_shape.apply(toy)
    # A stack that fails half-way is rolled back.
    with pytest.raises(EditLoadError):
        apply_edits(toy, [_edit(7), wrong_shape])
    assert torch.equal(toy.layers[0].weight, original)
    with pytest.raises(EditError, match="already applied"):
        e = _edit(8).apply(toy)
        e.apply(toy)
    e.restore(toy)
    assert torch.equal(toy.layers[0].weight, original)


def test_save_load_round_trip_without_pickle(toy: Toy, tmp_path) -> None:
    edits = [_edit(9), _edit(10, node="layers_1", d_in=5)]
    folder = save_edits(edits, tmp_path / "edits")
    assert sorted(p.name for p in folder.iterdir()) == ["edit.json", "edit.safetensors"]
    meta = json.loads((folder / "edit.json").read_text())
    assert [e["node"] for e in meta["edits"]] == ["layers_0", "layers_1"]
    assert meta["edits"][0]["request"]["target_new"] == {"str": "London"}
    loaded = load_edits(folder)
    for a, b in zip(edits, loaded):
        assert a.node == b.node and torch.equal(a.u, b.u) and torch.equal(a.v, b.v)
        assert b.request == a.request
    single = _edit(11)
    single.save(tmp_path / "one")
    again = Edit.load(tmp_path / "one")
    original = toy.layers[0].weight.detach().clone()
    again.apply(toy)
    single.apply(Toy())  # same factors on another model: same delta
    assert torch.allclose(toy.layers[0].weight - original, torch.outer(single.v, single.u).float(), atol=1e-6)
    again.restore(toy)
    assert torch.equal(toy.layers[0].weight, original)
    with pytest.raises(EditLoadError, match="no edit.json"):
        load_edits(tmp_path / "missing")


def test_fingerprint_check(toy: Toy) -> None:
    from gradpatch import model_fingerprint

    edit = _edit(12)
    edit.model_fingerprint = model_fingerprint(toy)
    edit.apply(toy, check_fingerprint=True)
    second = _edit(13)
    second.model_fingerprint = edit.model_fingerprint  # computed before the first edit: stale now
    with pytest.raises(EditLoadError, match="fingerprint"):
        second.apply(toy, check_fingerprint=True)
    edit.restore(toy)
