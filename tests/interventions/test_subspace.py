"""Trainable subspace patches (DAS, Boundless DAS, sigmoid masks) and interchange interventions on a tiny Llama."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from gradpatch import Intervention, PatchableGraph, ProbePatch
from gradpatch.errors import FingerprintMismatchError, InterventionLoadError, SubspaceConfigError
from gradpatch.interventions.interchange import InterchangeSide, interchange, interchange_logits, last_token_of
from gradpatch.interventions.subspace import (BoundlessSubspacePatch, FullInterchangePatch, RotatedSubspacePatch,
                                              SigmoidMaskPatch)
from recipes.testing import tiny_backbone

NODE = "model.layers_0.output"
BASES = ["the city of Paris is in", "the capital of Italy is"]
SOURCES = ["the city of Rome is in", "a big red car"]


def _orthonormality_error(rotation: torch.Tensor) -> float:
    eye = torch.eye(rotation.shape[0])
    return float((rotation @ rotation.T - eye).abs().max())


@pytest.fixture(scope="module")
def backbone() -> tuple[PatchableGraph, object]:
    model, tokenizer = tiny_backbone()
    ids = tokenizer(BASES, add_special_tokens=False, padding=True, return_tensors="pt")
    pg = PatchableGraph(model, ids["input_ids"], attention_mask=ids["attention_mask"],
                        position_ids=torch.zeros_like(ids["input_ids"]), use_cache=False)
    pg.requires_grad_(False)
    return pg, tokenizer


def _sides(tokenizer: object, base_position: object = "last", source_position: object = "last"):
    return (InterchangeSide.encode(tokenizer, BASES, base_position),
            InterchangeSide.encode(tokenizer, SOURCES, source_position))


def _run(pg, tokenizer, patch, node: str = NODE, shared_batch: bool = True, **positions) -> torch.Tensor:
    base, source = _sides(tokenizer, **positions)
    output = interchange(pg, {node: patch}, base, source, pad_id=tokenizer.pad_token_id, shared_batch=shared_batch,
                         use_cache=False)
    return interchange_logits(output, len(BASES))[:, -1]


def _manual(pg, tokenizer, patch_for_source) -> torch.Tensor:
    """Record the source activation at its last token in a source run, then patch the base run by hand."""
    logits = []
    for base, source in zip(BASES, SOURCES):
        probe = ProbePatch(slice=(slice(None), -1))
        s_ids = torch.tensor([tokenizer(source, add_special_tokens=False)["input_ids"]])
        with pg.patch({NODE: probe}):
            pg(s_ids, attention_mask=torch.ones_like(s_ids), position_ids=torch.arange(s_ids.shape[1])[None],
               use_cache=False)
        patch = patch_for_source(probe.activation)
        b_ids = torch.tensor([tokenizer(base, add_special_tokens=False)["input_ids"]])
        with pg.patch({NODE: patch}):
            out = pg(b_ids, attention_mask=torch.ones_like(b_ids), position_ids=torch.arange(b_ids.shape[1])[None],
                     use_cache=False)
        logits.append(out.logits[0, -1])
    return torch.stack(logits)


def test_full_dimension_rotation_equals_full_interchange(backbone) -> None:
    pg, tokenizer = backbone
    torch.manual_seed(0)
    full = RotatedSubspacePatch(64, 64)
    replaced = _manual(pg, tokenizer, lambda source: _replace(source))
    torch.testing.assert_close(_run(pg, tokenizer, full), replaced, atol=1e-4, rtol=1e-4)
    unpatched = _manual(pg, tokenizer, lambda source: ProbePatch())
    assert (replaced - unpatched).abs().max() > 1e-3  # the interchange changes the output


def _replace(source: torch.Tensor):
    from gradpatch import ReplacePatch

    return ReplacePatch(value=source[0], slice=(slice(None), -1))


@pytest.mark.parametrize("shared_batch", [True, False])
@pytest.mark.parametrize("kind", ["rotated", "boundless", "mask"])
def test_interchange_equals_a_manual_patch_of_the_recorded_source(backbone, kind: str, shared_batch: bool) -> None:
    pg, tokenizer = backbone
    torch.manual_seed(1)
    patch = {"rotated": lambda: RotatedSubspacePatch(64, 8), "boundless": lambda: BoundlessSubspacePatch(64, 0.3),
             "mask": lambda: SigmoidMaskPatch(64, init=0.5)}[kind]()
    patch.slice = (slice(None), -1)

    def manual(source: torch.Tensor):
        patch.source = source[0]
        return patch

    torch.testing.assert_close(_run(pg, tokenizer, patch, shared_batch=shared_batch), _manual(pg, tokenizer, manual),
                               atol=1e-4, rtol=1e-4)


def test_gradients_reach_only_patch_parameters_and_rotation_stays_orthonormal(backbone, tmp_path: Path) -> None:
    pg, tokenizer = backbone
    torch.manual_seed(2)
    patch = RotatedSubspacePatch(64, 4)
    optimizer = torch.optim.Adam(patch.parameters(), lr=0.05)
    target = torch.tensor([5, 7])
    before = patch.R.detach().clone()
    for step in range(6):  # both layouts: one batch, and a truncated source pass then the base
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(_run(pg, tokenizer, patch, shared_batch=step % 2 == 0), target)
        loss.backward()
        assert all(p.grad is None for p in pg.parameters())
        assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in patch.parameters())
        optimizer.step()
    assert (patch.R.detach() - before).abs().max() > 1e-3  # it trained
    assert _orthonormality_error(patch.R.detach()) <= 1e-5
    Intervention({NODE: patch}).save(tmp_path, model=pg.wrapped_model)
    loaded = Intervention.load(tmp_path, graph=pg).trainable[0]
    assert isinstance(loaded, RotatedSubspacePatch)
    assert _orthonormality_error(loaded.R.detach()) <= 1e-5
    torch.testing.assert_close(loaded.R, patch.R)
    torch.testing.assert_close(_run(pg, tokenizer, loaded), _run(pg, tokenizer, patch))


def test_a_saved_rotation_is_r_itself_and_older_files_load_too(tmp_path: Path) -> None:
    """The file holds R ``[k, d]`` (and a Boundless patch's full R and boundary), not torch's parametrization
    internals; loading gives R bit for bit, and a loaded patch trains on with R orthonormal. Files of format version 3
    (the parametrization's ``original`` and ``base``) load to the same R."""
    torch.manual_seed(3)
    rotated, boundless = RotatedSubspacePatch(64, 4), BoundlessSubspacePatch(8, 0.25)
    optimizer = torch.optim.Adam([*rotated.parameters(), *boundless.parameters()], lr=0.05)
    for _ in range(3):
        optimizer.zero_grad()
        ((rotated.R @ torch.randn(64, 3)) ** 3).sum().add((boundless.R ** 3).sum()).backward()
        optimizer.step()
    Intervention({NODE: [rotated], "model.layers_1.output": [boundless]}).save(tmp_path / "new")
    records = json.loads((tmp_path / "new" / "intervention.json").read_text())["patches"]
    assert [sorted(r["tensors"]) for r in records] == [["rotation.weight"], ["boundary", "rotation.weight"]]
    assert records[0]["tensors"]["rotation.weight"]["shape"] == [4, 64]
    loaded = Intervention.load(tmp_path / "new").trainable
    for original, copy in zip((rotated, boundless), loaded):
        assert torch.equal(copy.R, original.R)
    assert torch.equal(loaded[1].boundary, boundless.boundary)
    copy = loaded[0]
    steps = torch.optim.Adam(copy.parameters(), lr=0.05)
    ((copy.R @ torch.randn(64, 3)) ** 3).sum().backward()
    steps.step()
    assert (copy.R - rotated.R).abs().max() > 1e-3 and _orthonormality_error(copy.R.detach()) <= 1e-5
    rotated.saved_state = rotated.state_dict  # type: ignore[method-assign]  # what version 3 wrote
    Intervention({NODE: rotated}).save(tmp_path / "old")
    (old,) = json.loads((tmp_path / "old" / "intervention.json").read_text())["patches"]
    assert sorted(old["tensors"]) == ["rotation.parametrizations.weight.0.base",
                                      "rotation.parametrizations.weight.original"]
    assert torch.equal(Intervention.load(tmp_path / "old").trainable[0].R, rotated.R)


def test_subject_positions_and_index_positions(backbone) -> None:
    pg, tokenizer = backbone
    assert last_token_of(tokenizer, "the city of Paris is in", "city of Paris") == 3
    side = InterchangeSide.encode(tokenizer, BASES, positions=[-1, 1], subjects=["Paris", None])
    assert side.positions == [[3], [1]]
    with pytest.raises(SubspaceConfigError, match="not in prompt"):
        InterchangeSide.encode(tokenizer, BASES, subjects=["London", "Italy"])
    with pytest.raises(SubspaceConfigError, match="does not fit a prompt"):
        InterchangeSide.encode(tokenizer, BASES, positions=9)


def test_bad_input_is_refused_before_any_forward(backbone) -> None:
    pg, tokenizer = backbone
    with pytest.raises(SubspaceConfigError, match="dim=65 must be"):
        RotatedSubspacePatch(64, 65)
    with pytest.raises(SubspaceConfigError, match="width=64"):
        with pg.patch({NODE: RotatedSubspacePatch(32, 4)}):
            pass
    with pytest.raises(SubspaceConfigError, match="without positions"):
        _run(pg, tokenizer, RotatedSubspacePatch(64, 4), base_position=None, source_position=None)
    with pytest.raises(SubspaceConfigError, match=r"not \[batch, seq, d\]"):
        _run(pg, tokenizer, RotatedSubspacePatch(64, 4), node="model.layers_0.self_attn.query_states")


def test_saved_intervention_with_other_kind_shape_or_model_is_refused(backbone, tmp_path: Path) -> None:
    pg, _ = backbone
    saved = Intervention({NODE: RotatedSubspacePatch(64, 4)})
    saved.save(tmp_path, model=pg.wrapped_model)
    with pytest.raises(InterventionLoadError, match="expects"):
        Intervention.load(tmp_path, graph=pg, like=Intervention({NODE: RotatedSubspacePatch(64, 8)}))
    with pytest.raises(InterventionLoadError, match="expects"):
        Intervention.load(tmp_path, graph=pg, like=Intervention({NODE: SigmoidMaskPatch(64)}))
    other, _ = tiny_backbone(seed=1)
    with pytest.raises(FingerprintMismatchError):
        Intervention.load(tmp_path, model=other)
    document = json.loads((tmp_path / "intervention.json").read_text())
    document["patches"][0]["config"]["dim"] = 5  # the saved tensors are of a dim-4 rotation
    (tmp_path / "intervention.json").write_text(json.dumps(document))
    with pytest.raises(InterventionLoadError, match="shape"):
        Intervention.load(tmp_path)


def test_boundless_and_mask_terms() -> None:
    boundless = BoundlessSubspacePatch(10, boundary=0.5)
    boundless.temperature = 0.01
    mask = boundless.mask().detach()
    assert mask[:4].min() > 0.99 and mask[6:].max() < 0.01
    assert boundless.stats() == {"boundary_width": 5.0}
    assert _orthonormality_error(boundless.R.detach()) <= 1e-5
    sigmoid = SigmoidMaskPatch(10, init=0.0)
    assert float(sigmoid.penalty()) == pytest.approx(5.0)
    base, source = torch.zeros(3, 10), torch.ones(3, 10)
    torch.testing.assert_close(sigmoid.intervene(base, source), torch.full((3, 10), 0.5))


def test_split_source_pass_stops_at_the_last_patched_node(backbone) -> None:
    from gradpatch import RecordPatch

    pg, tokenizer = backbone
    later = RecordPatch()
    with pg.patch({"model.layers_1.output": later}):
        _run(pg, tokenizer, RotatedSubspacePatch(64, 4), shared_batch=False)
    assert [tuple(a.shape) for a in later.activations] == [(2, 6, 64)]  # the base pass only: the source pass stopped


MLP_NODE = "model.layers_1.mlp.output"
SECOND_SOURCES = ["my friend", "the dog is very"]


def _recorded(pg, tokenizer, prompt: str, node: str) -> torch.Tensor:
    """The activation ``[d]`` at ``node`` and the last token of ``prompt`` run alone (a ProbePatch)."""
    ids = torch.tensor([tokenizer(prompt, add_special_tokens=False)["input_ids"]])
    probe = ProbePatch(slice=(slice(None), -1))
    with pg.patch({node: probe}):
        pg(ids, attention_mask=torch.ones_like(ids), position_ids=torch.arange(ids.shape[1])[None], use_cache=False)
    return probe.activation[0]


def _replaced_by_hand(pg, tokenizer, sources_of: dict[str, list[str]]) -> torch.Tensor:
    """Last-token logits ``[B, V]`` of each base run alone with a ReplacePatch at each node's last token holding
    what that node's source prompt recorded there."""
    from gradpatch import ReplacePatch

    logits = []
    for i, base in enumerate(BASES):
        patches = {node: ReplacePatch(value=_recorded(pg, tokenizer, prompts[i], node), slice=(slice(None), -1))
                   for node, prompts in sources_of.items()}
        ids = torch.tensor([tokenizer(base, add_special_tokens=False)["input_ids"]])
        with pg.patch(patches):
            out = pg(ids, attention_mask=torch.ones_like(ids), position_ids=torch.arange(ids.shape[1])[None],
                     use_cache=False)
        logits.append(out.logits[0, -1])
    return torch.stack(logits)


@pytest.mark.parametrize("shared_batch", [True, False])
def test_two_nodes_each_read_their_own_source(backbone, shared_batch: bool) -> None:
    """Several sources per base: the residual stream after layer 0 from the first source, layer 1's MLP output from
    the second (prompts of other lengths than the base's and each other's), against the recorded-then-replaced
    computation. The MLP output is added to the residual stream, so both interchanges reach the last logits."""
    pg, tokenizer = backbone
    base = InterchangeSide.encode(tokenizer, BASES, "last")
    sources = [InterchangeSide.encode(tokenizer, prompts, "last") for prompts in (SOURCES, SECOND_SOURCES)]
    output = interchange(pg, {NODE: FullInterchangePatch(64), MLP_NODE: FullInterchangePatch(64)}, base, sources,
                         pad_id=tokenizer.pad_token_id, source_of={NODE: 0, MLP_NODE: 1}, shared_batch=shared_batch,
                         use_cache=False)
    logits = interchange_logits(output, len(BASES))[:, -1]
    expected = _replaced_by_hand(pg, tokenizer, {NODE: SOURCES, MLP_NODE: SECOND_SOURCES})
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
    # Each interchange matters, and each node's source is its own: other assignments give other logits.
    for other in ({NODE: SOURCES}, {MLP_NODE: SECOND_SOURCES}, {NODE: SECOND_SOURCES, MLP_NODE: SOURCES}):
        assert (_replaced_by_hand(pg, tokenizer, other) - expected).abs().max() > 1e-3, other
