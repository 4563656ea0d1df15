"""The exact sweep's position-prefix cache: variants patched at position p run tokens [p, end) on the base run's KV
cache, with the same scores as the whole computation; models that cannot take the cache run whole prompts."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from gradpatch import PatchableGraph, testing
from gradpatch.attribution import PromptBatch, exact_sweep

KW = {"use_cache": False}
POSITIONS = [0, 1, 3, 5]  # a whole pass, then 1 cached token, 3 cached with 3 suffix tokens, 1 suffix token


def _batch(rows: int = 3, seq: int = 6, seed: int = 0) -> PromptBatch:
    g = torch.Generator().manual_seed(seed)
    return PromptBatch(torch.randint(3, 100, (rows, seq), generator=g), torch.randint(3, 100, (rows, seq), generator=g),
                       torch.randint(3, 100, (rows,), generator=g), torch.randint(3, 100, (rows,), generator=g))


def _graph(family: str, **config) -> PatchableGraph:
    builder = testing.tiny_llama if family == "llama" else testing.tiny_gpt2
    return PatchableGraph(builder(128, layers=3, **config), _batch().clean, use_cache=False)


def _sweeps(pg: PatchableGraph, nodes, direction: str = "noise", positions=POSITIONS):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cached = exact_sweep(pg, _batch(), nodes, positions=positions, direction=direction, batch_size=9,
                             forward_kwargs=KW)
    whole = exact_sweep(pg, _batch(), nodes, positions=positions, direction=direction, batch_size=9,
                        forward_kwargs=KW, share_prefix=False)
    assert [(s.node, s.position, s.head) for s in cached.scores] == [(s.node, s.position, s.head) for s in whole.scores]
    exact = torch.tensor([s.score for s in whole.scores])
    torch.testing.assert_close(torch.tensor([s.score for s in cached.scores]), exact, atol=1e-5, rtol=0)
    assert exact.abs().max() > 1e-2  # the patches do change the metric
    return cached, whole, [str(w.message) for w in caught if "exact_sweep" in str(w.message)]


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("direction", ["noise", "denoise"])
def test_the_cached_sweep_equals_the_whole_computation(family, direction):
    cached, whole, warned = _sweeps(_graph(family), ["resid", "heads", "mlp"], direction)
    assert not warned
    # 3 layers x (1 + 4 + 1) = 18 units per position, 3 variants per pass: 6 passes per position. Cached: 2 recordings,
    # 1 check of the shared blocks, 1 pass filling the cache, 3 checks of it (one per class of sizes: from positions
    # 1, 3 and 5), then passes of 6, 5, 3 and 1 tokens; whole: 2 recordings and 24 passes, all of 6 tokens
    assert cached.forward == 2 + 1 + 1 + 3 + 4 * 6 and whole.forward == 2 + 24
    assert cached.forward_tokens == 3 * 6 + 6 + (5 + 3 + 1) + 6 * (6 + 5 + 3 + 1)
    assert whole.forward_tokens == 26 * 6


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_the_cached_sweep_of_node_paths_and_queries_equals_the_whole_computation(family):
    """NodePaths share no blocks (every block runs on every row, every cache layer is repeated); queries and keys are
    heads-first values whose suffix positions shift too."""
    paths = (["model.layers_1.mlp.down_proj.output", "model.layers_0.input_layernorm.output"] if family == "llama"
             else ["transformer.h_1.mlp.c_fc.output", "transformer.h_0.ln_1.output"])
    cached, whole, warned = _sweeps(_graph(family), paths, positions=[1, 2, 4, 5])
    # 2 units per position, 3 variants per pass: 2 recordings, 1 pass filling the cache, 3 checks of it (from positions
    # 1, 2 and 5), then one pass per position of 5, 4, 2 and 1 tokens
    assert not warned and cached.forward == 2 + 1 + 3 + 4
    assert cached.forward_tokens == 2 * 6 + 6 + (5 + 4 + 1) + (5 + 4 + 2 + 1)
    cached, _, warned = _sweeps(_graph(family), ["queries", "keys"], direction="denoise")
    assert not warned


def test_eager_attention_uses_the_cache_but_whole_passes_share_no_blocks():
    """Eager attention materialises its causal mask for the base rows' batch, so in whole-prompt passes the blocks
    before the first patched one cannot run on the base rows alone (the check finds it); the suffix passes' own mask
    broadcasts, so without position 0 they share blocks."""
    pg = _graph("llama", attn_implementation="eager")
    cached, whole, warned = _sweeps(pg, ["resid", "mlp"])
    assert not warned and cached.forward_tokens < whole.forward_tokens
    cached, whole, warned = _sweeps(pg, ["resid", "mlp"], positions=[2, 3, 5])
    assert not warned and cached.forward == 2 + 1 + 2 + 3 * 2  # no check of the shared blocks


class CausalMixer(nn.Module):
    """A causal toy language model whose forward takes no KV cache: position t sees the mean of embeddings 0..t."""

    def __init__(self, vocab: int = 128, width: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.mix = nn.Linear(width, width)
        self.head = nn.Linear(width, vocab)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        counts = torch.arange(1, x.shape[1] + 1, device=x.device, dtype=x.dtype).view(1, -1, 1)
        return self.head(x + torch.tanh(self.mix(x.cumsum(1) / counts)))


def test_a_model_without_a_cache_runs_whole_prompts():
    torch.manual_seed(0)
    pg = PatchableGraph(CausalMixer().eval(), _batch().clean)
    batch = _batch()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cached = exact_sweep(pg, batch, ["mix.output", "embed.output"], batch_size=9)
    whole = exact_sweep(pg, batch, ["mix.output", "embed.output"], batch_size=9, share_prefix=False)
    assert not [w for w in caught if "exact_sweep" in str(w.message)]
    assert [s.score for s in cached.scores] == [s.score for s in whole.scores]
    assert max(abs(s.score) for s in whole.scores) > 1e-3
    # 12 units, 3 per pass: 2 recordings and 4 passes, every one over all 6 tokens
    assert cached.forward == 2 + 4 and cached.forward_tokens == 6 * cached.forward


def test_a_sliding_window_fails_the_check_and_runs_whole_prompts():
    """Mistral's sliding window (2 tokens of a 6-token prompt) is not the causal attention the cache's mask describes:
    the check before the sweep finds it, warns, and every pass runs the whole prompt, every block on every row."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    config = MistralConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, sliding_window=2, initializer_range=0.3,
                           max_position_embeddings=64)
    pg = PatchableGraph(MistralForCausalLM(config).eval(), _batch().clean, use_cache=False)
    cached, whole, warned = _sweeps(pg, ["resid", "mlp"], positions=[1, 3, 5])
    assert len(warned) == 1 and "position-prefix cache" in warned[0]
    assert cached.forward_tokens == 6 * cached.forward
