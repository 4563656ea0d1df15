"""The value search on a bfloat16 copy of the model: it follows the float32 search, tracks the model's weights,
refuses weights it cannot copy, and MEMIT/AlphaEdit use it without writing to the model while computing."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from editors import ContextPrefixes, Corpus, EditRequest, compute_key, resolve_layer
from editors.alphaedit import AlphaEdit, AlphaEditConfig
from editors.config import MEMITConfig
from editors.errors import EditError
from editors.memit import MEMIT
from editors.value.batch_objective import BatchValueObjective
from editors.value.batch_search import optimize_values
from editors.value.search_copy import SearchCopy, search_dtype
from gradpatch import PatchableGraph
from gradpatch.model_io import model_dtype, wrapped_model
from gradpatch.testing import TOY_SENTENCES, byte_level_tokenizer, tiny_llama

TEMPLATES = ContextPrefixes(prefixes=("", "The river flows. ", "I think you know. "))
REQUESTS = [EditRequest("The river flows into the sea near {}", "the old town", "Rome"),
            EditRequest("I think the answer is {}", "the bridge", "Paris"),
            EditRequest("Because it rains, we stay home in {}", "Madrid", "Berlin")]
NODE = "model.layers_0.mlp.down_proj"
NODES = [NODE, "model.layers_1.mlp.down_proj"]
CORPUS = Corpus(name="toy", texts=list(TOY_SENTENCES) * 4)


def _graph(layers: int = 2):
    tok = byte_level_tokenizer()
    pg = PatchableGraph(tiny_llama(len(tok), layers=layers), torch.randint(0, len(tok), (2, 6)), use_cache=False)
    return pg.eval(), tok


def _state(pg) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in wrapped_model(pg).state_dict().items()}


def test_bfloat16_copy_search_follows_the_float32_one():
    pg, tok = _graph()
    layer = resolve_layer(pg, NODE)
    v0 = torch.stack([layer.forward_value(compute_key(pg, tok, layer, r.prompt, r.subject, TEMPLATES))
                      for r in REQUESTS]).detach()
    original = _state(pg)
    copy = SearchCopy(pg, tok, torch.bfloat16)
    fast_pg = copy.graph()
    assert model_dtype(fast_pg) == torch.bfloat16 and model_dtype(pg) == torch.float32
    assert copy.attention == "eager"  # on the CPU the copy's attention is matrix products, the model's stays SDPA
    ids = torch.randint(0, len(tok), (2, 5))
    with torch.no_grad(), sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):  # no CPU kernel: SDPA would fail here
        fast_pg(ids, use_cache=False)
        with pytest.raises(RuntimeError, match="scaled_dot_product_attention"):
            pg(ids, use_cache=False)
    runs = {}
    for name, graph in (("exact", pg), ("fast", fast_pg)):
        objective = BatchValueObjective(graph, tok, resolve_layer(graph, NODE), REQUESTS, TEMPLATES, v0,
                                        clamp_factor=500.0)
        assert objective.math_attention == (name == "fast")  # bfloat16 on CPU: attention as matrix products
        runs[name] = optimize_values(objective, steps=8, early_stop_loss=0.0)
    for exact, fast in zip(runs["exact"], runs["fast"]):
        assert fast.delta.dtype == torch.float32 and fast.steps == exact.steps == 8
        assert fast.history[-1]["loss"] == pytest.approx(exact.history[-1]["loss"], rel=0.05)
        assert fast.history[-1]["loss"] < fast.history[0]["loss"]
        assert float(nn.functional.cosine_similarity(fast.delta, exact.delta, dim=0)) > 0.95
    assert all(torch.equal(original[k], v) for k, v in _state(pg).items())  # the model itself is untouched


def test_copy_tracks_the_models_weights_and_keeps_buffer_dtypes():
    pg, tok = _graph()
    copy = SearchCopy(pg, tok, torch.bfloat16)
    weight = resolve_layer(pg, NODE).weight
    with torch.no_grad():
        weight.add_(1.0)  # as an applied edit would
    fast = resolve_layer(copy.graph(), NODE).weight
    assert fast.dtype == torch.bfloat16 and torch.equal(fast, weight.detach().to(torch.bfloat16))
    model_buffers = dict(wrapped_model(pg).named_buffers())
    for name, buffer in copy.copy.named_buffers():
        assert buffer.dtype == model_buffers[name].dtype  # e.g. rotary frequencies stay float32
    assert search_dtype(None) is None and search_dtype("bfloat16") == torch.bfloat16
    with pytest.raises(ValueError, match="'int8' is not one of bfloat16, float16, float32"):
        search_dtype("int8")


def test_copy_refuses_weights_it_cannot_copy():
    pg, tok = _graph()
    layer = wrapped_model(pg).model.layers[1].mlp.down_proj
    layer.weight = nn.Parameter(torch.empty_like(layer.weight, device="meta"))  # an offloaded placeholder
    with pytest.raises(EditError, match="value_dtype=None"):
        SearchCopy(pg, tok, torch.bfloat16)


def test_memit_and_alphaedit_search_on_the_copy(monkeypatch):
    pg, tok = _graph(layers=3)
    searched: list[tuple[torch.Tensor, torch.Tensor]] = []  # (copy's weight, model's weight) at each search
    graph = SearchCopy.graph

    def recording(self):
        fast = graph(self)
        searched.append((resolve_layer(fast, NODE).weight.detach().clone(), resolve_layer(pg, NODE).weight.detach()
                         .to(torch.bfloat16)))
        return fast

    monkeypatch.setattr(SearchCopy, "graph", recording)
    config = dict(n_samples=32, max_length=64, progress=False, use_cache=False, clamp_factor=500.0,
                  context_length_params=((5, 4), (10, 4)), steps=15, value_dtype="bfloat16")
    with pytest.raises(ValueError, match="value_dtype 'half'"):
        MEMIT(pg, tok, NODES, MEMITConfig(**{**config, "value_dtype": "half"}), corpus=CORPUS)
    original = _state(pg)
    memit = MEMIT(pg, tok, NODES, MEMITConfig(**config, mom2_update_weight=1.0), corpus=CORPUS)
    batch = memit.compute(REQUESTS)
    assert all(torch.equal(original[k], v) for k, v in _state(pg).items())  # compute writes nothing
    assert batch.info["converged"] and all(f["steps"] >= 1 for f in batch.info["facts"])
    alpha = AlphaEdit(pg, tok, NODES, AlphaEditConfig(**config, nullspace_threshold=1.0), corpus=CORPUS)
    alpha.edit(REQUESTS[:2])
    alpha.edit(REQUESTS[2:])  # searched on the copy of the model with the first batch written
    assert len(searched) == 3 and all(torch.equal(fast, model) for fast, model in searched)
    assert not torch.equal(searched[2][0], searched[1][0])
    alpha.restore_all()
    assert all(torch.equal(original[k], v) for k, v in _state(pg).items())
