"""Interventions on disk: atomic writes, fingerprints checked by default, damaged files named, no NaN saved."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save as save_safetensors

from gradpatch import AddPatch, Intervention, PatchableGraph, ReplacePatch, ZeroPatch, model_fingerprint
from gradpatch.errors import FingerprintMismatchError, InterventionLoadError, NonFiniteError
from gradpatch.files.atomic import atomic_write_bytes, sha256_hex

NODE = "model.layers_0.mlp.down_proj.output"


def _intervention(seed: int = 0) -> Intervention:
    g = torch.Generator().manual_seed(seed)
    return Intervention({NODE: [AddPatch(value=torch.randn(64, generator=g), slice=(slice(None), -1)),
                                ZeroPatch(slice=(Ellipsis, 3))]})


def _rewrite_json(folder: Path, change) -> None:
    path = folder / "intervention.json"
    document = json.loads(path.read_text())
    change(document)
    path.write_text(json.dumps(document))


def test_atomic_write_keeps_the_old_file_when_the_write_fails(tmp_path, monkeypatch) -> None:
    target = tmp_path / "file.bin"
    atomic_write_bytes(target, b"old")

    def failing_fsync(fd: int) -> None:
        raise OSError("disk full")

    monkeypatch.setattr("gradpatch.files.atomic.os.fsync", failing_fsync)
    with pytest.raises(OSError, match="disk full"):
        atomic_write_bytes(target, b"new contents")
    assert target.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file.bin"]  # no temporary file left


def test_load_checks_the_fingerprint_by_default(tiny_llama, token_ids, tmp_path) -> None:
    folder = _intervention().save(tmp_path / "i", model=tiny_llama)
    saved = model_fingerprint(tiny_llama)
    pg = PatchableGraph(tiny_llama, token_ids, use_cache=False)
    weight = tiny_llama.model.layers[0].mlp.down_proj.weight
    original = weight.detach().clone()
    with torch.no_grad():
        weight.mul_(1.5)  # the model the user now holds differs
    try:
        current = model_fingerprint(tiny_llama)
        for kwargs in ({"model": tiny_llama}, {"graph": pg}):  # the graph's own model is checked too
            with pytest.raises(FingerprintMismatchError) as info:
                Intervention.load(folder, **kwargs)
            assert saved in str(info.value) and current in str(info.value)
            assert "check_fingerprint=False" in str(info.value) and "intervention.json" in str(info.value)
        loaded = Intervention.load(folder, graph=pg, check_fingerprint=False)
        assert len(loaded.values) == 1
    finally:
        with torch.no_grad():
            weight.copy_(original)
    assert len(Intervention.load(folder, model=tiny_llama).values) == 1


def test_an_interrupted_save_leaves_a_pair_that_fails_to_load(tmp_path, monkeypatch) -> None:
    folder = _intervention(0).save(tmp_path / "i")
    before = (folder / "intervention.json").read_text()

    def crash(path: Path, text: str) -> Path:
        raise KeyboardInterrupt  # the process dies after the tensors file, before the JSON

    monkeypatch.setattr("gradpatch.interventions.intervention.atomic_write_text", crash)
    with pytest.raises(KeyboardInterrupt):
        _intervention(1).save(folder)
    assert (folder / "intervention.json").read_text() == before
    with pytest.raises(InterventionLoadError, match="different saves"):
        Intervention.load(folder)


def _wrong_rank(folder: Path) -> None:
    data = save_safetensors({"values.0": torch.zeros(8, 8)})  # 64 elements, but the record says [64]
    (folder / "intervention.safetensors").write_bytes(data)
    _rewrite_json(folder, lambda d: d.update(tensors_sha256=sha256_hex(data)))


DAMAGES = {
    "empty tensors": (lambda f: (f / "intervention.safetensors").write_bytes(b""), "intervention.safetensors"),
    "truncated tensors": (lambda f: (f / "intervention.safetensors").write_bytes(
        (f / "intervention.safetensors").read_bytes()[:40]), "intervention.safetensors"),
    "garbage tensors, no digest": (lambda f: [(f / "intervention.safetensors").write_bytes(b"not safetensors" * 9),
                                              _rewrite_json(f, lambda d: d.pop("tensors_sha256"))],
                                   "not a readable safetensors file"),
    "truncated json": (lambda f: (f / "intervention.json").write_text((f / "intervention.json").read_text()[:30]),
                       "intervention.json"),
    "json list": (lambda f: (f / "intervention.json").write_text("[]"), "intervention.json"),
    "no patches": (lambda f: _rewrite_json(f, lambda d: d.pop("patches")), "intervention.json"),
    "record without slice": (lambda f: _rewrite_json(f, lambda d: d["patches"][0].pop("slice")), "patch 0"),
    "custom kind": (lambda f: _rewrite_json(f, lambda d: d["patches"][1].update(kind="CustomPatch")), "CustomPatch"),
    "empty component": (lambda f: _rewrite_json(f, lambda d: d["patches"][0].update(
        path="model..layers_0.mlp.down_proj.output")), "empty names"),
    "bad slice": (lambda f: _rewrite_json(f, lambda d: d["patches"][0].update(slice={"slice": 3})), "slice"),
    "missing tensor": (lambda f: _rewrite_json(f, lambda d: d["patches"][0].update(value="values.7")), "values.7"),
    "wrong rank": (_wrong_rank, "shape [8, 8]"),
    "newer version": (lambda f: _rewrite_json(f, lambda d: d.update(version=99)), "version"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_damaged_files_raise_intervention_load_error(damage: str, tmp_path) -> None:
    folder = _intervention().save(tmp_path / "i")
    change, expected = DAMAGES[damage]
    change(folder)
    with pytest.raises(InterventionLoadError) as info:
        Intervention.load(folder)
    message = str(info.value)
    assert expected in message and str(folder) in message


def test_missing_files_name_the_folder(tmp_path) -> None:
    with pytest.raises(InterventionLoadError, match="does not exist"):
        Intervention.load(tmp_path / "nothing")


def test_version_1_files_still_load(tmp_path) -> None:
    folder = _intervention().save(tmp_path / "i")
    _rewrite_json(folder, lambda d: [d.update(version=1), d.pop("tensors_sha256"),
                                     [(r.pop("shape", None), r.pop("dtype", None)) for r in d["patches"]]])
    loaded = Intervention.load(folder)
    assert torch.equal(loaded.values[0], _intervention().values[0])


def test_non_finite_values_are_not_saved(tmp_path) -> None:
    bad = Intervention({NODE: AddPatch(value=torch.tensor([1.0, float("nan")]))})
    with pytest.raises(NonFiniteError, match=NODE):
        bad.save(tmp_path / "bad")
    assert not (tmp_path / "bad").exists()


def test_python_number_values_round_trip(tmp_path) -> None:
    folder = Intervention({NODE: ReplacePatch(value=2.5, slice=(0, 1))}).save(tmp_path / "i")
    patch = Intervention.load(folder).patch_map()[NODE][0]
    assert isinstance(patch, ReplacePatch) and patch.value == 2.5 and patch.slice == (0, 1)
