"""Attribution graphs on every family of gradpatch.testing.FAMILIES (tiny random models, random skip transcoders at
both MLPs): the logit rows are complete (each logit = Σ incoming edges + its bias, within 1e-4 of Σ|terms|), Gemma 2's
final logit soft-capping is linearised (found from the graph's ops), its attention-logit soft-capping lies inside the
frozen pattern, post-norm families' post-feedforward norms are frozen, and a graph that is not complete is refused."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import gradpatch.circuits.replacement as replacement_module
from gradpatch import PatchableGraph, testing
from gradpatch.circuits import (IncompleteGraphError, ReplacementModel, attribute, completeness, default_tolerance,
                                find_frozen_nodes)
from gradpatch.dictionaries import SkipTranscoder

#: family -> (the MLP module's NodePath with {} for the layer, its input node's name, its output node's name).
MLPS: dict[str, tuple[str, str, str]] = {
    "qwen3_moe": ("model.layers_{}.mlp", "hidden_states", "output"),
    "mixtral": ("model.layers_{}.mlp", "hidden_states", "output"),
    "phi3": ("model.layers_{}.mlp", "hidden_states", "output"),
    "gpt_oss": ("model.layers_{}.mlp", "hidden_states", "output|sub_0"),  # the MoE returns (output, router scores)
    "gpt2": ("transformer.h_{}.mlp", "hidden_states", "output"),
    "gptj": ("transformer.h_{}.mlp", "hidden_states", "output"),
    "falcon": ("transformer.h_{}.mlp", "x", "output"),
    "gpt_neox": ("gpt_neox.layers_{}.mlp", "hidden_states", "output"),
}
LLAMA_MLP = ("model.layers_{}.mlp", "x", "output")

#: Gemma 2's final logit soft-capping for the tiny model: its random logits are within ±0.5, so a cap of 0.5 bends
#: them as a trained Gemma 2's logits (tens) are bent by its cap of 30.
SOFT_CAP = 0.5


@pytest.fixture(scope="module")
def prompt() -> torch.Tensor:
    return torch.randint(3, 100, (1, 7), generator=torch.Generator().manual_seed(3))


def _model(family: str) -> torch.nn.Module:
    extra = {"final_logit_softcapping": SOFT_CAP} if family == "gemma2" else {}
    return testing.tiny_causal_lm(family, hidden=64, **extra)


def _replacement(family: str, prompt: torch.Tensor) -> ReplacementModel:
    """ReLU skip transcoders (128 latents, decoder scaled by 0.05 so that features do not dwarf the model's own MLP
    outputs) at both MLPs of ``family``'s tiny model."""
    module, read, write = MLPS.get(family, LLAMA_MLP)
    pg = PatchableGraph(_model(family), prompt, use_cache=False)
    generator = torch.Generator().manual_seed(0)
    transcoders = {}
    for layer in range(2):
        mlp = module.format(layer)
        transcoder = SkipTranscoder(64, 128, activation="relu", input_node=f"{mlp}.{read}",
                                    output_node=f"{mlp}.{write}", generator=generator)
        with torch.no_grad():
            transcoder.W_dec.mul_(0.05)
            transcoder.W_skip.normal_(0, 0.05, generator=generator)
            transcoder.b_dec.normal_(0, 0.01, generator=generator)
        transcoders[layer] = transcoder
    return ReplacementModel(pg, transcoders, prompt)


def test_gemma2_soft_capping_is_found_from_the_graph(prompt) -> None:
    """The final soft-capping's tanh (after the final norm's rsqrt, the last frozen node) is linearised, with slope
    1 − tanh²(z⁰) per logit (z = logits / cap); the attention-logit soft-capping's tanh runs before the frozen
    softmax, inside the pattern, and is left alone."""
    replacement = _replacement("gemma2", prompt)
    frozen = replacement.frozen
    assert [(op.input, op.output) for op in frozen.linearised] == [("logits_1", "logits_2")]
    assert frozen.attention == ("model.layers_0.self_attn.softmax", "model.layers_1.self_attn.softmax")
    paths = replacement.pg.node_paths()
    for layer in range(2):
        capping = f"model.layers_{layer}.self_attn.attn_weights_2"
        assert replacement.pg.node(capping)._gp_op == "call_function:tanh"
        assert paths.index(capping) < paths.index(frozen.attention[layer])
    (op, z0, y0, slope), = replacement.linearised_values
    torch.testing.assert_close(y0, torch.tanh(z0))
    torch.testing.assert_close(slope, 1 - torch.tanh(z0) ** 2)
    assert float(slope.min()) < 0.5  # the cap bends the logits: a linear term would not do
    with torch.no_grad():
        assert torch.equal(replacement.run().logits, replacement.logits)  # the tangent replays the prompt bit for bit


@pytest.mark.parametrize("family", ["gemma2", "gemma3", "olmo2"])
def test_post_feedforward_norms_are_frozen(family) -> None:
    """Post-norm families pass the MLP output through a norm before the residual stream: its scale is frozen."""
    pg = PatchableGraph(_model(family), torch.zeros(1, 4, dtype=torch.long), use_cache=False)
    norms = find_frozen_nodes(pg).norms
    assert all(f"model.layers_{layer}.post_feedforward_layernorm.rsqrt" in norms for layer in range(2))


@pytest.mark.parametrize("family", sorted(testing.FAMILIES))
def test_every_logit_row_is_complete(family, prompt) -> None:
    """attribute() returns the graph (it checks completeness itself), and each logit = Σ edges + bias within 1e-4
    of Σ|terms| (measured: at most 4e-7 on every family)."""
    replacement = _replacement(family, prompt)
    with torch.no_grad():
        assert torch.equal(replacement.run().logits, replacement.logits)
    graph = attribute(replacement, batch_size=64)
    assert graph.n_features > 100 and len(graph.logit_tokens) >= 1
    logit_errors = completeness(replacement, graph).errors[graph.n_features:]
    assert float(logit_errors.max()) <= 1e-4, family


def test_incomplete_graph_is_refused(prompt, monkeypatch) -> None:
    """Gemma 2 with its soft-capping left live (the linearisation switched off): the logit rows miss the tanh's
    curvature (1e-2 of Σ|terms|), and attribute() refuses the graph, naming the logit node and the error."""
    found = replacement_module.find_frozen_nodes
    monkeypatch.setattr(replacement_module, "find_frozen_nodes",
                        lambda pg: dataclasses.replace(found(pg), linearised=()))
    replacement = _replacement("gemma2", prompt)
    assert not replacement.frozen.linearised
    with pytest.raises(IncompleteGraphError, match=r"logit node \d+ \(token \d+ at the last position\).*error of "
                                                   r"0\.0\d+ of Σ\|terms\|.*above the tolerance 0\.0001"):
        attribute(replacement, batch_size=64)
    graph = attribute(replacement, batch_size=64, completeness_tolerance=1.0)
    assert float(completeness(replacement, graph).errors[graph.n_features:].max()) > 1e-3


def test_default_tolerance() -> None:
    assert default_tolerance(torch.float32) == default_tolerance(torch.float64) == 1e-4
    assert default_tolerance(torch.bfloat16) == 4 * torch.finfo(torch.bfloat16).eps
    assert default_tolerance(torch.float16) == 4 * torch.finfo(torch.float16).eps
