"""MEMIT and AlphaEdit on tiny random models: the closed forms, the multi-layer pipeline, statistics for several
layers in one pass, sequential batches, and bad input refused with the weights untouched."""

from __future__ import annotations

import pytest
import torch

import editors.statistics.second_moment as stats_module
from editors import Corpus, EditRequest, layer_second_moment, load_cases, resolve_layer
from editors.alphaedit import AlphaEdit, AlphaEditConfig
from editors.config import MEMITConfig
from editors.edits.edit import Edit
from editors.edits.patches import updated_weight_patches
from editors.errors import ConflictingRequestsError, LayerKindError, StatisticsError, SubjectNotFoundError
from editors.memit import MEMIT
from editors.passes.scoring import mean_target_logprobs
from editors.solve.multi_update import alphaedit_factors, memit_factors, null_space_projector
from editors.statistics.keys import context_activations, subject_first_activations
from editors.statistics.second_moment import layer_second_moments
from gradpatch import PatchableGraph
from gradpatch.testing import TOY_SENTENCES, byte_level_tokenizer, tiny_llama

NODES = [f"model.layers_{i}.mlp.down_proj" for i in range(2)]
# Random tiny models barely move information between positions, so the toy facts end with their subject.
REQUESTS = [EditRequest("The river flows into the sea near {}", "the old town", "Rome"),
            EditRequest("I think the answer is {}", "the bridge", "Paris"),
            EditRequest("Because it rains, we stay home in {}", "Madrid", "Rome")]
CORPUS = Corpus(name="toy", texts=list(TOY_SENTENCES) * 4)


def _config(cls=MEMITConfig, **overrides):
    # Tiny random models' MLP outputs are ~100x smaller than their residual stream: loosen the clamp (as the ROME
    # tests do) and weigh the preserved keys less than on a real model.
    base = dict(n_samples=32, max_length=64, progress=False, use_cache=False, clamp_factor=500.0,
                context_length_params=((5, 4), (10, 4)), steps=15)
    return cls(**{**base, **overrides})


def _setup(layers: int = 3):
    tok = byte_level_tokenizer()
    pg = PatchableGraph(tiny_llama(len(tok), layers=layers), torch.randint(0, len(tok), (2, 6)), use_cache=False)
    return pg.eval(), tok


def _weights(pg, nodes=NODES) -> list[torch.Tensor]:
    return [resolve_layer(pg, node).weight.detach().clone() for node in nodes]


def _logp(pg, tok, requests=REQUESTS) -> torch.Tensor:
    return mean_target_logprobs(lambda ids: pg(ids, use_cache=False), tok, [r.text for r in requests],
                                [r.target_new for r in requests])


def test_memit_closed_form_solves_eq_14():
    generator = torch.Generator().manual_seed(0)
    d_in, d_out, n = 12, 5, 4
    samples = torch.randn(200, d_in, generator=generator, dtype=torch.float64)
    c = samples.T @ samples / 200
    keys = torch.randn(n, d_in, generator=generator, dtype=torch.float64)
    residuals = torch.randn(n, d_out, generator=generator, dtype=torch.float64)
    u, v = memit_factors(keys, residuals, c, mom2_update_weight=3.0)
    delta = v @ u.T  # [d_out, d_in]
    # Normal equations of eq. 14: ΔW (λC + K Kᵀ) = R Kᵀ.
    torch.testing.assert_close(delta @ (3.0 * c + keys.T @ keys), residuals.T @ keys)
    # With the preserved keys weighed ever less, the new keys map to their residuals exactly.
    u, v = memit_factors(keys, residuals, c, mom2_update_weight=1e-9)
    torch.testing.assert_close((v @ u.T) @ keys.T, residuals.T, rtol=1e-5, atol=1e-6)
    with pytest.raises(StatisticsError, match="my.node: .*singular"):
        memit_factors(keys, residuals, torch.zeros(d_in, d_in, dtype=torch.float64), 0.0, node="my.node")


def test_alphaedit_update_spares_the_preserved_keys():
    generator = torch.Generator().manual_seed(1)
    d_in, d_out = 10, 4
    basis = torch.linalg.qr(torch.randn(d_in, d_in, generator=generator, dtype=torch.float64))[0]
    c = basis @ torch.diag(torch.tensor([5.0, 3, 2, 1, 0.5, 0.2, 1e-4, 1e-5, 0, 0], dtype=torch.float64)) @ basis.T
    projector, n_null = null_space_projector(c, threshold=1e-2)
    assert n_null == 4
    torch.testing.assert_close(projector @ projector, projector)
    keys = torch.randn(3, d_in, generator=generator, dtype=torch.float64)
    residuals = torch.randn(3, d_out, generator=generator, dtype=torch.float64)
    u, v = alphaedit_factors(keys, residuals, projector, torch.zeros(d_in, d_in, dtype=torch.float64), l2=0.1)
    delta = v @ u.T
    preserved = basis[:, :6]  # eigenvectors of C with eigenvalues above the threshold
    assert float((delta @ preserved).abs().max()) < 1e-10
    assert float((delta @ keys.T).abs().max()) > 1e-3  # the new keys do move
    with pytest.raises(StatisticsError, match="no eigenvalue.*below.*raise nullspace_threshold"):
        null_space_projector(c + torch.eye(d_in, dtype=torch.float64), threshold=1e-2)


def test_statistics_for_several_layers_in_one_pass(tmp_path, monkeypatch):
    pg, tok = _setup()
    nodes = ["model.layers_2.mlp.down_proj", "model.layers_0.mlp.down_proj"]
    passes = []
    real = stats_module.compute_second_moments
    monkeypatch.setattr(stats_module, "compute_second_moments",
                        lambda *a, **k: passes.append(len(a[2])) or real(*a, **k))
    together = layer_second_moments(pg, tok, nodes, corpus=CORPUS, n_samples=16, cache_dir=tmp_path, progress=False)
    assert passes == [2]  # both layers in one pass over the corpus
    for node, moment in zip(nodes, together):
        alone = layer_second_moment(pg, tok, node, corpus=CORPUS, n_samples=16, use_cache=False, progress=False)
        torch.testing.assert_close(moment.matrix, alone.matrix)
        assert moment.n_tokens == alone.n_tokens and moment.input_node == node + ".input"
    again = layer_second_moments(pg, tok, nodes + ["model.layers_1.mlp.down_proj"], corpus=CORPUS, n_samples=16,
                                 cache_dir=tmp_path, progress=False)
    assert passes == [2, 1, 1, 1]  # the two single-layer checks, then only the new layer: the others were cached
    assert torch.equal(again[0].matrix, together[0].matrix)


def test_memit_edits_many_facts_and_restores_bit_exactly():
    pg, tok = _setup()
    memit = MEMIT(pg, tok, list(reversed(NODES)), _config(mom2_update_weight=1.0), corpus=CORPUS)
    assert memit.nodes == NODES and memit.residual_node == "model.layers_1.output"  # forward order
    original = _weights(pg)
    before = _logp(pg, tok)
    batch = memit.compute(REQUESTS)
    assert all(torch.equal(a, b) for a, b in zip(_weights(pg), original))  # compute writes nothing
    assert [e.rank for e in batch.edits] == [3, 3] and batch.info["n_facts"] == 3
    assert len(batch.info["facts"]) == 3 and all(f["steps"] >= 1 for f in batch.info["facts"])
    batch.apply(pg)
    after = _logp(pg, tok)
    assert bool((after > before + 1.0).all()), (before, after)
    # The first layer took its share of the residual, so less is left for the second.
    left = [layer["residual_left_norm"] for layer in batch.info["layers"]]
    assert left[1] < left[0]
    batch.restore(pg)
    assert all(torch.equal(a, b) for a, b in zip(_weights(pg), original))
    batch.apply(pg, mode="patch")
    torch.testing.assert_close(_logp(pg, tok), after, rtol=0, atol=1e-4)
    batch.restore(pg)


def test_later_layers_are_measured_on_the_weights_the_edit_writes():
    # MEMIT measures each layer with the earlier layers' updates as weight patches: the same logits as the written edit.
    pg, tok = _setup()
    layer = resolve_layer(pg, NODES[0])
    generator = torch.Generator().manual_seed(0)
    u = torch.randn(layer.d_in, 3, generator=generator, dtype=torch.float64)
    v = torch.randn(layer.d_out, 3, generator=generator, dtype=torch.float64)
    ids = torch.randint(0, len(tok), (2, 7), generator=generator)
    original = _weights(pg)
    with torch.no_grad():
        plain = pg(ids, use_cache=False).logits
        with pg.patch(updated_weight_patches(layer, u, v)):
            patched = pg(ids, use_cache=False).logits
        assert all(torch.equal(a, b) for a, b in zip(_weights(pg), original))
        edit = Edit(node=layer.path, u=u, v=v).apply(pg)
        written = pg(ids, use_cache=False).logits
        edit.restore(pg)
    assert torch.equal(patched, written) and not torch.equal(patched, plain)


def test_bad_input_is_named_and_weights_stay(tmp_path):
    pg, tok = _setup()
    original = _weights(pg)
    with pytest.raises(LayerKindError, match="'model.layers_0.mlp' is a LlamaMLP"):
        MEMIT(pg, tok, ["model.layers_0.mlp", NODES[1]], _config(), corpus=CORPUS)
    memit = MEMIT(pg, tok, NODES, _config(), corpus=CORPUS)
    conflicting = REQUESTS + [EditRequest("I think the answer is {}", "the old town", "Berlin")]
    with pytest.raises(ConflictingRequestsError, match="Requests 0 and 3 .*'the old town'.*'Rome'.*'Berlin'"):
        memit.edit(conflicting)
    record = {"case_id": 17, "requested_rewrite": {"prompt": "The capital of France is", "subject": "Spain",
                                                   "target_new": "Madrid", "target_true": "Paris"}}
    with pytest.raises(SubjectNotFoundError, match=r"Case 17 \(record 1\): Template 'The capital of France is' must"):
        load_cases([{**record, "case_id": 16, "requested_rewrite": REQUESTS[0].to_dict() | {"target_true": "x"}},
                    record])
    singular = MEMIT(pg, tok, NODES, _config(mom2_update_weight=0.0), corpus=CORPUS,
                     statistics=[torch.zeros(64, 64), torch.zeros(64, 64)])
    with pytest.raises(StatisticsError, match="model.layers_0.mlp.down_proj: .*singular"):
        singular.edit(REQUESTS)
    assert all(torch.equal(a, b) for a, b in zip(_weights(pg), original))


def test_alphaedit_sequential_batches():
    pg, tok = _setup()
    original = _weights(pg)
    alpha = AlphaEdit(pg, tok, NODES, _config(AlphaEditConfig, nullspace_threshold=1.0), corpus=CORPUS)
    first = alpha.edit(REQUESTS[:2])
    assert first.info["method"] == "alphaedit" and first.info["earlier_batches"] == 0
    assert all(0 < n < 64 for n in first.info["null_space_dimensions"].values())
    assert all(float(p.abs().sum()) > 0 for p in alpha.previous)  # the first batch's keys are remembered
    second = alpha.edit(REQUESTS[2:])
    assert second.info["earlier_batches"] == 1 and second.model_fingerprint != first.model_fingerprint
    # Every update lies in the projector's range: keys the statistics span are mapped as before.
    for edit, projector in zip(first.edits + second.edits, alpha.projectors() * 2):
        torch.testing.assert_close(projector @ edit.u, edit.u, rtol=1e-6, atol=1e-8)
    alpha.restore_all()
    assert all(torch.equal(a, b) for a, b in zip(_weights(pg), original)) and alpha.previous == []


def _change_at(batch, keys: list[torch.Tensor]) -> list[float]:
    """‖ΔW k‖ / ‖k‖ of each layer's update at that layer's key ``k`` ``[d_in]``."""
    return [float((e.v @ (e.u.T @ k.to(torch.float64))).norm() / k.norm()) for e, k in zip(batch.edits, keys)]


@pytest.mark.parametrize("cls, overrides", [(MEMITConfig, dict(mom2_update_weight=1.0)),
                                            (AlphaEditConfig, dict(nullspace_threshold=1.0))])
def test_preserved_keys_keep_their_outputs(cls, overrides):
    pg, tok = _setup()
    editor = (AlphaEdit if cls is AlphaEditConfig else MEMIT)(pg, tok, NODES, _config(cls, **overrides),
                                                              corpus=CORPUS)
    keep = [("Because it rains, we stay home in {}", "the old bridge")]  # like the edited facts, not one of them
    keys = [k[0].mean(dim=0) for k in context_activations(pg, editor.tokenizer, [f"{n}.input" for n in NODES], keep,
                                                          editor.templates().subset(editor.config.key_prefixes))]
    free = _change_at(editor.compute(REQUESTS), keys)
    editor.preserve(keep, weight=1e6)
    assert [tuple(p.shape) for p in editor.preserved] == [(64, 64), (64, 64)]
    if isinstance(editor, AlphaEdit):
        editor.forget()  # drops earlier batches' keys, not the preserved ones
        assert editor.preserved
    batch = editor.compute(REQUESTS)
    assert batch.info["preserved_facts"] == 1
    kept = _change_at(batch, keys)
    # Without them the update moves the kept subject's keys; with them it (almost) leaves their outputs alone.
    assert all(f > 1e-3 for f in free), free
    assert all(k < 1e-3 * f for k, f in zip(kept, free)), (kept, free)


def test_preserve_refuses_bad_input():
    pg, tok = _setup()
    memit = MEMIT(pg, tok, NODES, _config(), corpus=CORPUS)
    with pytest.raises(ValueError, match="at least one"):
        memit.preserve([])
    with pytest.raises(ValueError, match="must be positive"):
        memit.preserve([("I think the answer is {}", "the bridge")], weight=0.0)
    with pytest.raises(SubjectNotFoundError, match="Fact 1 "):
        memit.preserve([("I think the answer is {}", "the bridge"), ("No subject here", "the bridge")])
    assert memit.preserved == [] and memit.n_preserved == 0


def test_memit_subject_first_key_is_one_more_column_with_the_facts_residual():
    pg, tok = _setup()
    node = NODES[1]
    memit = MEMIT(pg, tok, [node], _config(), corpus=CORPUS)  # the subject-first key: MEMIT's default
    batch = memit.compute(REQUESTS)
    c = memit.config
    input_node = memit.layers[0].input_node
    facts = [(r.prompt, r.subject) for r in REQUESTS]
    averaged = context_activations(pg, memit.tokenizer, [input_node], facts,
                                   memit.templates().subset(c.key_prefixes))[0].mean(dim=1)  # k* [F, d_in]
    first = subject_first_activations(pg, memit.tokenizer, [input_node], [r.subject for r in REQUESTS])[0]  # [F, 1, d]
    residuals = torch.stack([r.delta for r in memit.last_values]).to(torch.float64)  # one layer: all of z - h
    weight = memit.update_weight(0, averaged)  # λ from k* alone
    assert batch.info["layers"][0]["mom2_update_weight"] == pytest.approx(weight)
    u, v = memit_factors(torch.cat([averaged.unsqueeze(1), first], dim=1), residuals,
                         memit.statistics()[0].matrix, weight)
    torch.testing.assert_close(batch.edits[0].u, u)
    torch.testing.assert_close(batch.edits[0].v, v)
    # the subject-first keys gain more of their fact's residual than under the averaged key alone
    plain = MEMIT(pg, tok, [node], _config(subject_first_key=False), corpus=CORPUS).compute(REQUESTS).edits[0]
    along = lambda edit: ((edit.v @ (edit.u.T @ first[:, 0].T.to(torch.float64))).T * residuals).sum(-1)  # noqa: E731
    assert bool((along(batch.edits[0]) > along(plain)).all())


def test_alphaedit_remembers_the_subject_first_keys_it_solved_for():
    pg, tok = _setup()
    alpha = AlphaEdit(pg, tok, [NODES[1]], _config(AlphaEditConfig, nullspace_threshold=1.0, subject_first_key=True),
                      corpus=CORPUS)
    alpha.edit(REQUESTS[:2])
    input_node = alpha.layers[0].input_node
    averaged = context_activations(pg, alpha.tokenizer, [input_node], [(r.prompt, r.subject) for r in REQUESTS[:2]],
                                   alpha.templates().subset(alpha.config.key_prefixes))[0].mean(dim=1)  # edited model
    first = subject_first_activations(pg, alpha.tokenizer, [input_node], [r.subject for r in REQUESTS[:2]])[0][:, 0]
    keys = torch.cat([averaged, first]).to(torch.float64)  # [2F, d_in]
    torch.testing.assert_close(alpha.previous[0], keys.T @ keys)
    alpha.restore_all()
