"""gradpatch/interventions/reft.py: LoReFT/DiReFT/AddVector patches, f+l positions, tied/untied, save/load checks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gradpatch import DiReFTPatch, Intervention, LoReFTPatch, PatchableGraph, ReFTPositions
from gradpatch.errors import InterventionLoadError, SubspaceConfigError
from gradpatch.interventions.reft import check_saved_reft, reft_patch_map

NODE = "model.layers_0.output"


def _graph(model: torch.nn.Module) -> PatchableGraph:
    ids = torch.randint(3, 100, (2, 6), generator=torch.Generator().manual_seed(0))
    return PatchableGraph(model, ids, attention_mask=torch.ones_like(ids), use_cache=False)


def test_loreft_and_direft_compute_the_paper_formulas() -> None:
    torch.manual_seed(0)
    h = torch.randn(3, 5, 16)
    lo = LoReFTPatch(16, 4)
    rotation = lo.R.detach()
    assert float((rotation @ rotation.T - torch.eye(4)).abs().max()) < 1e-5
    expected = h + (h @ lo.projection.weight.T + lo.projection.bias - h @ rotation.T) @ rotation
    torch.testing.assert_close(lo.edit(h), expected, rtol=0, atol=1e-6)
    di = DiReFTPatch(16, 3)
    torch.testing.assert_close(di.edit(h), h + (h @ di.projection.weight.T + di.projection.bias) @ di.up,
                               rtol=0, atol=1e-6)
    with torch.no_grad():  # W = R, b = 0: Φ is the identity
        lo.projection.weight.copy_(rotation)
        lo.projection.bias.zero_()
    torch.testing.assert_close(lo.edit(h), h, rtol=0, atol=1e-5)


def test_loreft_edit_is_pyreft_s_expression_bit_for_bit() -> None:
    """pyreft 0.1.0's LoreftIntervention stores Rᵀ ``[d, r]`` (contiguous) and computes
    h + (W h + b − h Rᵀ) (Rᵀ)ᵀ in this order (benchmarks/interventions/reft_pyreft.py: both on the real model)."""
    torch.manual_seed(0)
    patch = LoReFTPatch(576, 4)
    h = torch.randn(2, 6, 576)
    with torch.no_grad():
        tall = patch.R.T.contiguous()
        learned = torch.nn.functional.linear(h, patch.projection.weight, patch.projection.bias)
        expected = h + torch.matmul(learned - torch.matmul(h, tall), tall.T)
        assert torch.equal(patch.edit(h), expected)


def test_positions_parse_and_columns() -> None:
    positions = ReFTPositions.parse("f2+l3")
    assert (positions.first, positions.last, str(positions)) == (2, 3, "f2+l3")
    assert positions.columns(7) == [0, 1, 4, 5, 6]
    assert positions.columns(7, "first") == [0, 1] and positions.columns(7, "last") == [4, 5, 6]
    assert positions.parts(tied=True) == ["all"] and positions.parts(tied=False) == ["first", "last"]
    assert ReFTPositions.parse("l1").parts(tied=False) == ["all"]
    with pytest.raises(SubspaceConfigError, match="need 5 prompt tokens"):
        positions.columns(4)
    for bad in ("x3", "f0+l0", ""):
        with pytest.raises(SubspaceConfigError):
            ReFTPositions.parse(bad)


@pytest.mark.parametrize("rank", [16, 17, 0])
def test_rank_at_or_above_the_width_is_refused(rank: int) -> None:
    with pytest.raises(SubspaceConfigError, match="rank"):
        LoReFTPatch(16, rank)
    with pytest.raises(SubspaceConfigError, match="rank"):
        DiReFTPatch(16, rank)


def test_patch_map_edits_only_the_prompt_positions_of_each_left_padded_row(tiny_llama: torch.nn.Module) -> None:
    pg = _graph(tiny_llama)
    torch.manual_seed(1)
    patch = LoReFTPatch(64, 4, positions="f1+l2")
    rows = [[5, 6, 7, 8, 9], [11, 12, 13]]
    ids = torch.tensor([rows[0], [0, 0] + rows[1]])
    mask = torch.tensor([[1] * 5, [0, 0, 1, 1, 1]])
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    with pg.patch(reft_patch_map({NODE: patch}, [5, 3], [0, 2])):
        batched = pg(ids, attention_mask=mask, position_ids=position_ids, use_cache=False).logits
    for i, row in enumerate(rows):  # each row alone (no padding) gives the same logits at its tokens
        single = torch.tensor([row])
        with pg.patch(reft_patch_map({NODE: patch}, [len(row)])):
            alone = pg(single, attention_mask=torch.ones_like(single), use_cache=False).logits
        torch.testing.assert_close(batched[i, -len(row):], alone[0], rtol=0, atol=1e-4)
    recorded = {}
    from gradpatch import ProbePatch

    for name, mapping in (("plain", {}), ("patched", reft_patch_map({NODE: patch}, [5], [0]))):
        probe = ProbePatch()
        with pg.patch({**mapping, NODE: [*mapping.get(NODE, []), probe]}):
            pg(ids[:1], attention_mask=mask[:1], use_cache=False)
        recorded[name] = probe.activation
    changed = (recorded["patched"] - recorded["plain"]).abs().amax(-1)[0]
    assert changed[[0, 3, 4]].min() > 0 and float(changed[[1, 2]].max()) == 0.0


def test_save_load_round_trip_and_refusals(tmp_path: Path, tiny_llama: torch.nn.Module) -> None:
    pg = _graph(tiny_llama)
    torch.manual_seed(2)
    patches = [LoReFTPatch(64, 4, positions="f1+l1", part="first"), LoReFTPatch(64, 4, positions="f1+l1",
                                                                                 part="last")]
    Intervention({NODE: patches}).save(tmp_path / "iv", model=tiny_llama)
    loaded = Intervention.load(tmp_path / "iv", graph=pg)
    h = torch.randn(2, 64)
    for saved, original in zip(loaded.trainable, patches):
        assert (saved.positions, saved.part, saved.rank) == (original.positions, original.part, original.rank)
        torch.testing.assert_close(saved.edit(h), original.edit(h), rtol=0, atol=0)
    check_saved_reft(tmp_path / "iv", {NODE: patches})
    cases = [({NODE: [LoReFTPatch(64, 8, "f1+l1", "first"), LoReFTPatch(64, 8, "f1+l1", "last")]}, "rank=4"),
             ({NODE: [LoReFTPatch(64, 4, "f2+l2", "first"), LoReFTPatch(64, 4, "f2+l2", "last")]}, "positions"),
             ({NODE: [LoReFTPatch(64, 4, "f1+l1")]}, "untied"),
             ({NODE: [DiReFTPatch(64, 4, "f1+l1", "first"), LoReFTPatch(64, 4, "f1+l1", "last")]}, "DiReFTPatch")]
    for expected, message in cases:
        with pytest.raises(InterventionLoadError, match=message):
            check_saved_reft(tmp_path / "iv", expected)
    from gradpatch.testing import tiny_llama as build
    from gradpatch.errors import FingerprintMismatchError

    other = build(100, seed=5, hidden=64, intermediate=128, init_std=0.02, max_position_embeddings=128,
                  pad_token_id=None, bos_token_id=1, eos_token_id=2)
    with pytest.raises(FingerprintMismatchError):
        Intervention.load(tmp_path / "iv", graph=_graph(other))
