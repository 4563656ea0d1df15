"""AtP*: the QK fix's vectorised recomputation against brute force, the recomputed attention against the model's,
and GradDrop's passes and magnitudes."""

from __future__ import annotations

import pytest
import torch

from gradpatch import testing
from gradpatch import AddPatch, PatchableGraph, ProbePatch, ReplacePatch
from gradpatch.attribution.atp_star import atp_star, attention_pattern, qk_fixed_totals

KW = {"use_cache": False}


def test_qk_fix_equals_recomputing_each_patched_query_and_key_alone():
    g = torch.Generator().manual_seed(0)
    batch, heads, kv_heads, seq, dim = 2, 4, 2, 5, 8
    q, q2 = (torch.randn(batch, heads, seq, dim, generator=g) * 2 for _ in range(2))
    k, k2 = (torch.randn(batch, kv_heads, seq, dim, generator=g) * 2 for _ in range(2))
    grad = torch.randn(batch, heads, seq, seq, generator=g)
    query_totals, key_totals = qk_fixed_totals(q, k, q2, k2, grad)
    base = attention_pattern(q, k)
    for t in range(seq):
        patched = q.clone()
        patched[:, :, t] = q2[:, :, t]
        expected = ((attention_pattern(patched, k) - base) * grad).sum((-1, -2))  # [batch, heads]
        torch.testing.assert_close(query_totals[:, t], expected, atol=1e-5, rtol=1e-4)
    for s in range(seq):
        patched = k.clone()
        patched[:, :, s] = k2[:, :, s]
        per_head = ((attention_pattern(q, patched) - base) * grad).sum((-1, -2))
        torch.testing.assert_close(key_totals[:, s], per_head.reshape(batch, kv_heads, -1).sum(-1), atol=1e-5,
                                   rtol=1e-4)
    assert bool((key_totals[:, -1].abs() > 0).all())  # the last key is seen by the last query


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_qk_fix_is_exact_up_to_the_attention_output(family):
    """Patch one query (or key) in the model itself and record the attention's output O' (before the heads merge):
    the QK-fixed estimate must equal (O' − O) · ∂M/∂O, the effect linearised only after the attention."""
    model = (testing.tiny_llama(100, hidden=64, intermediate=128, init_std=0.3, max_position_embeddings=128,
                                pad_token_id=None, bos_token_id=1, eos_token_id=2) if family == "llama"
             else testing.tiny_gpt2(100, hidden=64, init_std=0.3, n_positions=128))
    batch = testing.random_prompt_batch()
    pg = PatchableGraph(model, batch.clean, use_cache=False)
    star = atp_star(pg, batch, ["queries", "keys"], forward_kwargs=KW)
    assert (star.forward, star.backward) == (2, 1)
    scores = star.score_map()
    prefix = "model.layers_1.self_attn." if family == "llama" else "transformer.h_1.attn."
    q_path, k_path, o_path = (prefix + name for name in (
        ("q_embed", "k_embed", "attn_output") if family == "llama" else
        ("query_states_1", "key_states_1", "attn_output")))
    probes = {path: ProbePatch() for path in (q_path, k_path)}
    with torch.no_grad(), pg.patch(probes):
        pg(batch.corrupted, use_cache=False)
    zero = torch.nn.Parameter(torch.zeros(pg.node(o_path).tensor_shape).expand(3, -1, -1, -1).contiguous())
    base_o = ProbePatch()
    with pg.patch({o_path: [base_o, AddPatch(value=zero)]}):
        logits = pg(batch.clean, use_cache=False).logits[:, -1]
        rows = torch.arange(3)
        metric = (logits[rows, batch.answer] - logits[rows, batch.foil]).mean()
        (grad,) = torch.autograd.grad(metric, [zero])
    checked = 0
    for path, head, position in ((q_path, 1, 4), (q_path, 3, 5), (k_path, 0, 2), (k_path, 1, 3)):
        index = (slice(None), head, position)
        patched_o = ProbePatch()
        with torch.no_grad(), pg.patch({path: ReplacePatch(value=probes[path].activation[index], slice=index),
                                        o_path: patched_o}):
            pg(batch.clean, use_cache=False)
        expected = float(((patched_o.activation - base_o.activation) * grad).sum())
        assert scores[(path, position, head)] == pytest.approx(expected, rel=1e-3, abs=1e-6)
        checked += abs(expected) > 1e-4
    assert checked >= 2  # the patches do move the attention


def test_grad_drop_runs_one_backward_per_block_and_gives_magnitudes(tiny_gpt2):
    batch = testing.random_prompt_batch()
    pg = PatchableGraph(tiny_gpt2, batch.clean, use_cache=False)
    plain = atp_star(pg, batch, ["mlp", "keys"], forward_kwargs=KW)
    dropped = atp_star(pg, batch, ["mlp", "keys"], grad_drop=True, forward_kwargs=KW)
    assert (dropped.forward, dropped.backward) == (1 + 3, 3)  # source, base, one per dropped block (2 blocks)
    assert all(s.score >= 0 for s in dropped.scores) and any(s.score > 0 for s in dropped.scores)
    # the last block's nodes see no other block downstream: dropping block 0 leaves their gradient alone, dropping
    # block 1 zeroes it, so with L - 1 = 1 their GradDrop score is |AtP| summed per prompt
    last = [(p, d) for p, d in zip(plain.scores, dropped.scores) if p.layer == 1 and p.kind == "mlp"]
    assert all(d.score >= abs(p.score) - 1e-6 for p, d in last)
