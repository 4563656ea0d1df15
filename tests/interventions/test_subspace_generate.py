"""Trained subspace patches during pg.generate with the KV cache: which positions they touch in prefill and decode."""

from __future__ import annotations

import warnings

import pytest
import torch

from gradpatch import PatchableGraph, ProbePatch, RotatedSubspacePatch
from gradpatch.positions import Tokens

NODE = "model.layers_0.output"
GREEDY = {"do_sample": False, "pad_token_id": 0, "max_new_tokens": 5}


class SpyPatch(RotatedSubspacePatch):
    """Records the shape of every base value it intervenes on (one entry per forward pass that it touches)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[tuple[int, ...]] = []

    def intervene(self, base: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        self.calls.append(tuple(base.shape))
        return super().intervene(base, source)


@pytest.fixture
def setup(tiny_llama, token_ids):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pg = PatchableGraph(tiny_llama, token_ids, use_cache=False)
    ids = token_ids[:1]
    probe = ProbePatch(slice=(slice(None), -1))
    with pg.patch({NODE: probe}):
        pg(token_ids[1:], use_cache=False)
    return pg, ids, probe.activation[0]  # the source: [d], the other prompt's last token


def test_absolute_position_is_touched_once_in_the_prefill(setup) -> None:
    pg, ids, source = setup
    torch.manual_seed(0)
    patch = SpyPatch(64, 64, slice=Tokens([3]))  # a full rotation: the source replaces position 3
    patch.source = source
    with pg.patch({NODE: patch}):
        cached = pg.generate(ids, **GREEDY)
    assert patch.calls == [(1, 1, 64)]  # prefill only; decode steps never see position 3
    with pg.patch({NODE: patch}):
        recomputed = pg.generate(ids, use_cache=False, **GREEDY)
    assert len(patch.calls) == 1 + GREEDY["max_new_tokens"]  # without a cache every step recomputes position 3
    assert torch.equal(cached, recomputed)
    scored = {**GREEDY, "output_logits": True, "return_dict_in_generate": True}
    with pg.patch({NODE: patch}):
        patched = pg.generate(ids, **scored).logits[0]
    assert (patched - pg.generate(ids, **scored).logits[0]).abs().max() > 1e-4  # the intervention acts


def test_last_position_is_the_last_prompt_token_then_each_new_token(setup) -> None:
    pg, ids, source = setup
    patch = SpyPatch(64, 8, slice=(slice(None), -1))
    patch.source = source
    with pg.patch({NODE: patch}):
        pg.generate(ids, **GREEDY)
    assert patch.calls == [(1, 64)] * GREEDY["max_new_tokens"]  # prefill (last prompt token) + 4 decode steps
