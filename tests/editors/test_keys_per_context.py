"""Keys per context: every context prompt's key gets the edit's full residual (ROME rank one, MEMIT rank F)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from editors import ROME, Corpus, Edit, EditRequest, ROMEConfig
from editors.errors import StatisticsError
from editors.solve.multi_update import alphaedit_factors, memit_factors
from editors.solve.rank_one import rank_one_update
from editors.statistics.keys import ContextPrefixes, context_activations, subject_first_activations
from gradpatch import PatchableGraph
from gradpatch.testing import TOY_SENTENCES, byte_level_tokenizer, tiny_llama

GEN = torch.Generator().manual_seed(0)
SAMPLES = torch.randn(400, 12, generator=GEN, dtype=torch.float64)
C = SAMPLES.T @ SAMPLES / 400


def test_rank_one_update_per_context_meets_every_key():
    keys = torch.randn(4, 12, generator=GEN, dtype=torch.float64)
    residual = torch.randn(5, generator=GEN, dtype=torch.float64)
    u, v = rank_one_update(keys, residual, C)
    torch.testing.assert_close(keys @ u, torch.ones(4, dtype=torch.float64))  # each context gains all of v
    # Of all u with K u = 1 it has the least C-norm: adding any null-space direction of K costs more.
    null = torch.linalg.svd(keys, full_matrices=True).Vh[4:].T  # [12, 8], K @ null = 0
    cost = lambda x: float(x @ torch.linalg.solve(torch.linalg.inv(C), x))  # noqa: E731  (uᵀ C u)
    assert all(cost(u) < cost(u + 0.1 * null[:, j]) for j in range(8))
    single, _ = rank_one_update(keys[2], residual, C)
    torch.testing.assert_close(rank_one_update(keys[2:3], residual, C)[0], single)  # P = 1 is eq. 2
    # A key given twice counts once, also when the copies differ by float32 rounding; a key that needs uᵀk = 2 (the
    # sum of two others) cannot be served.
    rounded = (keys[1].float() + 1e-7 * keys[1].abs().float()).double()
    twice, _ = rank_one_update(torch.cat([keys, keys[:1], rounded[None]]), residual, C)
    torch.testing.assert_close(twice, u)
    with pytest.raises(StatisticsError, match="linearly dependent"):
        rank_one_update(torch.cat([keys, (keys[0] + keys[1])[None]]), residual, C)


def test_memit_and_alphaedit_per_context_equal_repeated_columns():
    keys = torch.randn(3, 4, 12, generator=GEN, dtype=torch.float64)  # 3 facts, 4 contexts
    residuals = torch.randn(3, 5, generator=GEN, dtype=torch.float64)
    u, v = memit_factors(keys, residuals, C, mom2_update_weight=2.0)
    k = keys.reshape(12, 12).T  # [d_in, F·P]
    r = residuals.repeat_interleave(4, dim=0).T  # [d_out, F·P]: each fact's residual for each of its contexts
    expected = r @ k.T @ torch.linalg.inv(2.0 * C + k @ k.T)
    assert u.shape == (12, 3)  # rank F, not F·P
    torch.testing.assert_close(v @ u.T, expected)
    projector = torch.eye(12, dtype=torch.float64)
    u, v = alphaedit_factors(keys, residuals, projector, torch.zeros(12, 12, dtype=torch.float64), l2=1.0)
    torch.testing.assert_close(v @ u.T, r @ k.T @ torch.linalg.inv(k @ k.T + torch.eye(12, dtype=torch.float64)))


def _tiny_graph() -> tuple[PatchableGraph, Any]:
    tok = byte_level_tokenizer()
    return PatchableGraph(tiny_llama(len(tok)), torch.randint(0, len(tok), (2, 6)), use_cache=False).eval(), tok


def _per_context_rome(pg: PatchableGraph, tok: Any, subject_first_key: bool = False) -> ROME:
    """ROME with keys per context at the tiny Llama's first MLP (toy statistics, 5 value steps)."""
    config = ROMEConfig(n_samples=32, max_length=64, progress=False, use_cache=False, clamp_factor=500.0,
                        context_length_params=((5, 4), (10, 4)), keys_per_context=True, steps=5,
                        subject_first_key=subject_first_key)
    return ROME(pg, tok, "model.layers_0.mlp.down_proj", config, corpus=Corpus(name="toy", texts=list(TOY_SENTENCES)))


def _edit_and_gain(rome: ROME, request: EditRequest, keys: torch.Tensor
                   ) -> tuple[Edit, torch.Tensor, torch.Tensor]:
    """Apply the edit; return it, what the layer's output at each of ``keys`` ``[P, d_in]`` gained ``[P, d_out]``,
    and the value search's ``δ`` ``[d_out]``."""
    before = rome.layer.forward_value(keys).detach()
    edit = rome.edit(request)
    return edit, rome.layer.forward_value(keys).detach() - before, rome.last_value.delta


def test_rome_keys_per_context_moves_every_context():
    pg, tok = _tiny_graph()
    rome = _per_context_rome(pg, tok)
    request = EditRequest("The river flows into the sea near {}", "the old town", "Rome")
    keys = context_activations(pg, rome.tokenizer, [rome.layer.input_node], [(request.prompt, request.subject)],
                               rome.templates())[0][0]
    edit, gain, delta = _edit_and_gain(rome, request, keys)  # gain [P, d_out]
    assert edit.u.shape == (rome.layer.d_in,) and edit.info["config"]["keys_per_context"] is True
    torch.testing.assert_close(gain, delta.expand_as(gain), rtol=1e-3, atol=1e-3 * float(delta.norm()))
    edit.restore(pg)


def test_rome_subject_first_key_moves_the_subject_at_the_start_of_the_text():
    pg, tok = _tiny_graph()
    request = EditRequest("The river flows into the sea near {}", "the old town", "Rome")
    gains = {}
    for first in (False, True):
        rome = _per_context_rome(pg, tok, subject_first_key=first)
        start = context_activations(pg, rome.tokenizer, [rome.layer.input_node], [("{}", request.subject)],
                                    ContextPrefixes(prefixes=("",)))[0][0]  # [1, d_in]: the text begins with it
        edit, gain, delta = _edit_and_gain(rome, request, start)
        gains[first] = (gain - delta).norm() / delta.norm()
        assert edit.info["n_key_prompts"] == len(rome.templates()) + first
        edit.restore(pg)
    assert gains[True] < 1e-3 < gains[False]  # only with the flag does that key gain the full residual δ


def test_rome_subject_first_key_beside_the_averaged_key():
    pg, tok = _tiny_graph()
    config = ROMEConfig(n_samples=32, max_length=64, progress=False, use_cache=False, clamp_factor=500.0,
                        context_length_params=((5, 4), (10, 4)), keys_per_context=False, subject_first_key=True,
                        steps=5)
    rome = ROME(pg, tok, "model.layers_0.mlp.down_proj", config, corpus=Corpus(name="toy", texts=list(TOY_SENTENCES)))
    request = EditRequest("The river flows into the sea near {}", "the old town", "Rome")
    node = rome.layer.input_node
    contexts = context_activations(pg, rome.tokenizer, [node], [(request.prompt, request.subject)],
                                   rome.templates())[0][0]  # [P, d_in]
    start = subject_first_activations(pg, rome.tokenizer, [node], [request.subject])[0][0]  # [1, d_in]
    key = torch.cat([contexts, start]).mean(dim=0)  # k*: the subject-first key averaged in
    edit, gain, delta = _edit_and_gain(rome, request, torch.stack([key, start[0], contexts[1]]))
    missed = (gain - delta).norm(dim=-1) / delta.norm()  # [3]: k*, the subject-first key, another context's key
    assert float(missed[:2].max()) < 1e-4 and float(missed[2]) > 10 * float(missed[:2].max())  # only the two solved
    edit.restore(pg)


def test_rome_subject_first_key_on_a_prompt_that_starts_with_the_subject():
    pg, tok = _tiny_graph()
    rome = _per_context_rome(pg, tok, subject_first_key=True)
    request = EditRequest("{} flows into the sea", "the old river", "Rome")  # the empty prefix gives the first key
    node = rome.layer.input_node
    keys = torch.cat([context_activations(pg, rome.tokenizer, [node], [(prompt, request.subject)], templates)[0][0]
                      for prompt, templates in ((request.prompt, rome.templates()),
                                                ("{}", ContextPrefixes(prefixes=("",))))])  # [P + 1, d_in]
    edit, gain, delta = _edit_and_gain(rome, request, keys)
    torch.testing.assert_close(gain, delta.expand_as(gain), rtol=1e-3, atol=1e-3 * float(delta.norm()))
    edit.restore(pg)
    # the empty prefix's key is already the subject-first one: it is neither solved for nor averaged into k* twice
    assert edit.info["n_key_prompts"] == len(rome.templates())
    assert edit.info["key_norm"] == _per_context_rome(pg, tok).compute(request).info["key_norm"]
