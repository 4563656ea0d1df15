"""Edge attribution on a tiny Llama: the per-edge routing reproduces the clean and corrupted runs, exact edge
patching against a direct patch, EAP's gradients against a direct gradient, the faithfulness curve's ends."""

from __future__ import annotations

import pytest
import torch

from gradpatch import AddPatch, PatchableGraph, ProbePatch
from gradpatch.attribution import AttributionError, PromptBatch
from gradpatch.attribution.edge_graph import EdgeGraph
from gradpatch.attribution.edges import eap, edge_patching
from gradpatch.testing import random_prompt_batch

KW = {"use_cache": False}


def _metric(pg: PatchableGraph, ids: torch.Tensor, batch: PromptBatch, patches=None) -> torch.Tensor:
    with pg.patch(patches or {}):
        logits = pg(ids, use_cache=False).logits[:, -1]
    if not logits.requires_grad:
        logits = logits.detach()
    rows = torch.arange(ids.shape[0])
    return (logits[rows, batch.answer] - logits[rows, batch.foil]).mean()


def test_edge_graph_names_and_reach(llama_graph):
    edges = EdgeGraph.of(llama_graph)  # 2 layers, 4 heads, 2 kv heads
    assert (edges.n_up, edges.n_down) == (1 + 2 * 5, 2 * (4 + 2 + 2 + 1) + 1)
    up, down, reach = edges.upstream_names(), edges.downstream_names(), edges.reach()
    assert up[:3] == ["embed", "a0.h0", "a0.h1"] and up[5] == "m0" and down[:5] == [
        "a0.h0.q", "a0.h1.q", "a0.h2.q", "a0.h3.q", "a0.h0.k"] and down[-1] == "logits"
    assert bool(reach[up.index("a0.h3"), down.index("m0")]) and not bool(reach[up.index("m0"), down.index("m0")])
    assert not bool(reach[up.index("a0.h0"), down.index("a0.h0.q")]) and bool(reach[up.index("m1"), -1])


@pytest.mark.parametrize("steps", [0, 3])
def test_faithfulness_curve_runs_from_the_corrupted_to_the_clean_run(llama_graph, steps):
    """With every edge corrupted, each input is rebuilt from the corrupted outputs: exactly the corrupted run."""
    batch = random_prompt_batch()
    result = eap(llama_graph, batch, steps=steps, fractions=(0.0, 0.1, 1.0), forward_kwargs=KW)
    with torch.no_grad():
        clean, corrupted = (float(_metric(llama_graph, ids, batch)) for ids in (batch.clean, batch.corrupted))
    assert result.metric_clean == pytest.approx(clean, abs=1e-5)
    assert result.metric_corrupted == pytest.approx(corrupted, abs=1e-5)
    assert [k for k, _ in result.faithfulness] == [0, 8, 82]
    assert result.faithfulness[0][1] == pytest.approx(0.0, abs=1e-4)
    assert result.faithfulness[-1][1] == pytest.approx(1.0, abs=1e-4)
    assert len(result.edges) == 82 and abs(result.edges[0].score) >= abs(result.edges[-1].score)
    assert result.backward == max(steps, 1) and result.method == ("eap-ig" if steps else "eap")


def test_exact_edge_patching_and_eap_into_the_logits_match_direct_patches(llama_graph):
    batch = random_prompt_batch()
    probes = {"model.embed_tokens.output": ProbePatch(), "model.layers_0.mlp.output": ProbePatch()}
    with torch.no_grad(), llama_graph.patch(probes):
        llama_graph(batch.corrupted, use_cache=False)
    clean = {path: ProbePatch() for path in probes}
    with torch.no_grad(), llama_graph.patch(clean):
        llama_graph(batch.clean, use_cache=False)
    with torch.no_grad():
        base = float(_metric(llama_graph, batch.clean, batch))
    zero = torch.nn.Parameter(torch.zeros(3, 6, 64))
    value = _metric(llama_graph, batch.clean, batch, {"model.norm.hidden_states": AddPatch(value=zero)})
    (grad,) = torch.autograd.grad(value, [zero])
    exact = {(e.upstream, e.downstream): e.score for e in edge_patching(
        llama_graph, batch, [("embed", "logits"), ("m0", "logits"), ("embed", "a1.h0.q")], batch_size=6,
        forward_kwargs=KW)}
    estimate = {(e.upstream, e.downstream): e.score
                for e in eap(llama_graph, batch, fractions=(), forward_kwargs=KW).edges}
    for name, path in (("embed", "model.embed_tokens.output"), ("m0", "model.layers_0.mlp.output")):
        difference = probes[path].activation - clean[path].activation
        with torch.no_grad():
            direct = float(_metric(llama_graph, batch.clean, batch,
                                   {"model.norm.hidden_states": AddPatch(value=difference)}))
        assert exact[(name, "logits")] == pytest.approx(direct - base, abs=1e-5)
        assert estimate[(name, "logits")] == pytest.approx(float((difference * grad).sum()), rel=1e-4, abs=1e-6)
    assert abs(exact[("embed", "a1.h0.q")]) > 0


def test_bad_edges_and_models_are_refused(llama_graph, tiny_gpt2):
    with pytest.raises(AttributionError, match="no edge 'm1' → 'm0'"):
        edge_patching(llama_graph, random_prompt_batch(), [("m1", "m0")], forward_kwargs=KW)
    with pytest.raises(AttributionError, match="Llama-style graph"):
        eap(PatchableGraph(tiny_gpt2, random_prompt_batch().clean, use_cache=False), random_prompt_batch(),
            forward_kwargs=KW)
    with pytest.raises(AttributionError, match="steps=-1"):
        eap(llama_graph, random_prompt_batch(), steps=-1, forward_kwargs=KW)
