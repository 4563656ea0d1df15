"""Rank-r edits and many-fact BatchEdits: bit-exact apply/restore, patches equal to weight writes, one file pair."""

from __future__ import annotations

import json

import pytest
import torch

from editors import Edit, EditRequest, load_edits, resolve_layer
from editors.edits.batch import BatchEdit
from editors.errors import EditError, EditFingerprintError, EditLoadError, EditNotConvergedError
from gradpatch import PatchableGraph, model_fingerprint
from gradpatch.testing import tiny_gpt2, tiny_llama

NODES = {"llama": ["model.layers_0.mlp.down_proj", "model.layers_1.mlp.down_proj"],
         "gpt2": ["transformer.h_0.mlp.c_proj", "transformer.h_1.mlp.c_proj"]}
REQUESTS = [EditRequest("The capital of {} is", "France", "London", "Paris"),
            EditRequest("The {} is located in", "Colosseum", "Paris", "Rome"),
            EditRequest("I think {} is", "Madrid", "Berlin")]


def _graph(kind: str) -> tuple[PatchableGraph, torch.Tensor]:
    model = (tiny_llama if kind == "llama" else tiny_gpt2)(100)
    ids = torch.randint(0, 100, (2, 9), generator=torch.Generator().manual_seed(1))
    return PatchableGraph(model, ids, use_cache=False), ids


def _batch(pg: PatchableGraph, kind: str, rank: int = 3, scale: float = 0.2) -> BatchEdit:
    generator = torch.Generator().manual_seed(0)
    edits = []
    for node in NODES[kind]:
        layer = resolve_layer(pg, node)
        edits.append(Edit(node=node, u=torch.randn(layer.d_in, rank, generator=generator, dtype=torch.float64) * scale,
                          v=torch.randn(layer.d_out, rank, generator=generator, dtype=torch.float64) * scale))
    info = {"method": "memit", "converged": True, "facts": [{"subject": r.subject, "converged": True}
                                                            for r in REQUESTS[:rank]]}
    return BatchEdit(edits=edits, requests=REQUESTS[:rank], model_fingerprint=model_fingerprint(pg.wrapped_model),
                     info=info)


def _weights(pg: PatchableGraph, kind: str) -> list[torch.Tensor]:
    return [resolve_layer(pg, node).weight.detach().clone() for node in NODES[kind]]


@pytest.mark.parametrize("kind", sorted(NODES))
def test_rank_r_weight_write_patches_and_bit_exact_restore(kind):
    pg, ids = _graph(kind)
    clean = pg(ids, use_cache=False).logits
    original = _weights(pg, kind)
    batch = _batch(pg, kind)
    batch.apply(pg)
    for edit, before in zip(batch.edits, original):
        layer = resolve_layer(pg, edit.node)
        expected = (edit.v @ edit.u.T).T if layer.transposed else edit.v @ edit.u.T  # V Uᵀ in storage layout
        torch.testing.assert_close(layer.weight - before, expected.float(), rtol=1e-5, atol=1e-6)
    weighted = pg(ids, use_cache=False).logits
    assert (weighted - clean).abs().max() > 1e-2
    with pytest.raises(EditError, match="already applied"):
        batch.apply(pg)
    batch.restore(pg)
    assert all(torch.equal(a, b) for a, b in zip(_weights(pg, kind), original))
    batch.apply(pg, mode="patch")
    assert all(torch.equal(a, b) for a, b in zip(_weights(pg, kind), original))  # patches leave weights alone
    torch.testing.assert_close(pg(ids, use_cache=False).logits, weighted, rtol=0, atol=1e-5)
    batch.restore(pg)
    with pg.patch(batch.as_patches(pg)):
        torch.testing.assert_close(pg(ids, use_cache=False).logits, weighted, rtol=0, atol=1e-5)
    assert torch.equal(pg(ids, use_cache=False).logits, clean)


def test_save_load_round_trip_and_formats(tmp_path):
    pg, ids = _graph("llama")
    batch = _batch(pg, "llama")
    folder = batch.save(tmp_path / "batch")
    loaded = BatchEdit.load(folder)
    assert [r.to_dict() for r in loaded.requests] == [r.to_dict() for r in batch.requests]
    assert loaded.model_fingerprint == batch.model_fingerprint and loaded.info == batch.info
    for a, b in zip(loaded.edits, batch.edits):
        assert a.node == b.node and a.rank == 3 and torch.equal(a.u, b.u) and torch.equal(a.v, b.v)
    original = _weights(pg, "llama")
    batch.apply(pg)
    written = _weights(pg, "llama")
    batch.restore(pg)
    loaded.apply(pg)
    assert all(torch.equal(a, b) for a, b in zip(_weights(pg, "llama"), written))  # the same bits as the original
    with pytest.raises(EditError, match="same factors"):
        BatchEdit.load(folder).apply(pg, check_fingerprint=False)  # a second copy loaded from the same files
    loaded.restore(pg)
    assert all(torch.equal(a, b) for a, b in zip(_weights(pg, "llama"), original))
    assert [e.rank for e in load_edits(folder)] == [3, 3]  # the per-layer view of the same folder
    # A ROME (rank-one) folder is no batch; a rank that disagrees with the factors is caught, naming the file.
    Edit(node=NODES["llama"][0], u=torch.ones(64), v=torch.ones(32)).save(tmp_path / "rome")
    with pytest.raises(EditLoadError, match="no many-fact 'batch' record"):
        BatchEdit.load(tmp_path / "rome")
    assert load_edits(tmp_path / "rome")[0].u.shape == (64,)
    meta = json.loads((folder / "edit.json").read_text())
    meta["edits"][1]["rank"] = 2
    (folder / "edit.json").write_text(json.dumps(meta))
    with pytest.raises(EditLoadError, match=r"edit.safetensors: '1.u' has shape \[64, 3\], but edit.json says \[64, 2\]"):
        BatchEdit.load(folder)


def test_refusals_leave_the_weights_untouched():
    pg, _ = _graph("llama")
    original = _weights(pg, "llama")
    batch = _batch(pg, "llama")
    batch.model_fingerprint = "0" * 16
    with pytest.raises(EditFingerprintError, match="differs"):
        batch.apply(pg)
    batch.apply(pg, check_fingerprint=False)
    batch.restore(pg)
    unconverged = _batch(pg, "llama")
    unconverged.info["converged"] = False
    unconverged.info["facts"][1]["converged"] = False
    with pytest.raises(EditNotConvergedError, match="'Colosseum'"):
        unconverged.apply(pg)
    # The second layer's change overflows float32: the first layer, already written, is restored.
    broken = _batch(pg, "llama")
    broken.edits[1].u = broken.edits[1].u * 1e30
    broken.edits[1].v = broken.edits[1].v * 1e30
    with pytest.raises(EditError, match="non-finite weights"):
        broken.apply(pg)
    assert not broken.applied
    assert all(torch.equal(a, b) for a, b in zip(_weights(pg, "llama"), original))
    with pytest.raises(EditError, match="not applied"):
        broken.restore(pg)
