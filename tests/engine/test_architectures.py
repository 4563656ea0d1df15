"""The architecture matrix: a tiny random model of every family in :data:`gradpatch.testing.FAMILIES` through
extraction, the layout (its identities), patches and gradients against plain forward hooks, cached generation, causal
tracing and node attribution against a hook-based computation of the same quantities, a spliced SAE, the router of a
mixture of experts, and compile. docs/architectures.md tabulates the results; circuits per family are in
tests/circuits/test_circuits_families.py, editing in tests/editors/test_architectures_editing.py, MoE compile in
tests/engine/test_compile_moe.py and MoE editing in tests/editors/test_edit_experts.py."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from torch import nn

from editors.causal_trace import causal_trace
from gradpatch import AddPatch, PatchableGraph, ProbePatch
from gradpatch.attribution import atp
from gradpatch.attribution.prompts import PromptBatch
from gradpatch.dictionaries import SparseAutoencoder, splice
from gradpatch.errors import CompilationWarning, LayoutError
from gradpatch.layouts import ModelLayout, detect_layout, layout_problems
from gradpatch.testing import FAMILIES, byte_level_tokenizer, tiny_causal_lm

#: The layout each family is detected as.
EXPECTED = {"llama": "llama", "mistral": "llama", "qwen2": "llama", "qwen3": "llama", "qwen3_moe": "moe",
            "mixtral": "moe", "gemma2": "gemma", "gemma3": "gemma", "phi3": "phi3", "gpt2": "gpt2",
            "gpt_neox": "gpt_neox", "olmo2": "olmo2", "falcon": "falcon", "stablelm": "stablelm", "gptj": "gptj",
            "gpt_oss": "gpt_oss", "cohere": "cohere", "granite": "granite"}
PROMPT, SUBJECT, ANSWER = "The Eiffel Tower is located in the city of", "Eiffel Tower", " Paris"


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return byte_level_tokenizer()


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request: pytest.FixtureRequest, tokenizer: Any) -> tuple[str, nn.Module, PatchableGraph, torch.Tensor]:
    """(family, model, graph, prompt ids ``[2, seq]``): the graph extracted on the trace prompt, batch 2."""
    name = request.param
    model = tiny_causal_lm(name, vocab_size=len(tokenizer))
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids.expand(2, -1)
    return name, model, PatchableGraph(model, ids, use_cache=False), ids


def _block_module(model: nn.Module, layout: ModelLayout, part: str, layer: int) -> nn.Module:
    """The plain model's module producing block part ``part`` (``"mlp"``, ``"attn"``, ``"hidden"``) at ``layer``."""
    prefix = layout.layer.split("{}")[0].rstrip("_")
    block = model.get_submodule(f"{prefix}.{layer}")
    if part == "hidden":
        return block
    if layout.family == "granite":  # what it adds is its block's ``mul``/``mul_1``: the module's output × multiplier
        return block.get_submodule({"attn": "self_attn", "mlp": "mlp"}[part])
    relative = getattr(layout, part).split("|")[0]
    relative = relative[: -len(".output")] if relative.endswith(".output") else relative
    return block.get_submodule(relative)


def _multiplier(model: nn.Module) -> float:
    """What a block multiplies its attention's and MLP's outputs by before the residual (Granite), else 1."""
    return float(getattr(model.config, "residual_multiplier", 1.0))


def _first(output: Any) -> torch.Tensor:
    return output[0] if isinstance(output, tuple) else output


def _replace_first(output: Any, value: torch.Tensor) -> Any:
    return (value, *output[1:]) if isinstance(output, tuple) else value


def _record(store: dict[str, torch.Tensor], key: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """A hook function keeping a copy of the value under ``key`` (the model may change it in place later: Falcon's
    ``mlp_output += attention_output``) and returning it unchanged."""
    def keep(value: torch.Tensor) -> torch.Tensor:
        store[key] = value.detach().clone()
        return value
    return keep


@contextmanager
def _hooks(*pairs: tuple[nn.Module, Callable[[torch.Tensor], torch.Tensor]]) -> Iterator[None]:
    """Plain forward hooks that map each module's (first) output through a function."""
    handles = [module.register_forward_hook(lambda _m, _i, out, f=f: _replace_first(out, f(_first(out))))
               for module, f in pairs]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def test_extraction_is_exact(family) -> None:
    _, model, pg, ids = family
    with torch.no_grad():
        assert torch.equal(pg(ids, use_cache=False).logits, model(ids, use_cache=False).logits)


def test_the_layout_is_detected_and_its_identities_hold(family) -> None:
    name, model, pg, ids = family
    layout = detect_layout(pg)
    assert layout.family == EXPECTED[name] and layout_problems(pg, layout) == ()
    # What tracing and attribution patch as "attn" / "mlp" / "hidden" is what the plain model's module there returns.
    probes = {layout.path(part, 1): ProbePatch() for part in ("attn", "mlp", "hidden")}
    seen: dict[str, torch.Tensor] = {}
    hooks = [(_block_module(model, layout, part, 1), _record(seen, part)) for part in ("attn", "mlp", "hidden")]
    with _hooks(*hooks), torch.no_grad():
        model(ids, use_cache=False)
    with torch.no_grad(), pg.patch(probes):
        pg(ids, use_cache=False)
    for part, value in seen.items():
        scale = 1.0 if part == "hidden" else _multiplier(model)
        assert torch.equal(probes[layout.path(part, 1)].activation, value * scale), part


def test_a_patch_and_its_gradient_equal_a_forward_hooks(family) -> None:
    _, model, pg, ids = family
    layout = detect_layout(pg)
    delta = torch.randn(pg.node(layout.embed).tensor_shape[-1], generator=torch.Generator().manual_seed(0)) * 0.1
    ours = nn.Parameter(delta.clone())
    with pg.patch({layout.path("mlp", 0): AddPatch(value=ours)}):
        patched = pg(ids, use_cache=False).logits
    patched.square().sum().backward()
    theirs = nn.Parameter(delta.clone())
    scale = _multiplier(model)  # Granite's contribution is the MLP's output × its multiplier
    with _hooks((_block_module(model, layout, "mlp", 0), lambda t: t + theirs / scale)):
        reference = model(ids, use_cache=False).logits
    reference.square().sum().backward()
    exact = 0.0 if scale == 1.0 else 1e-6
    torch.testing.assert_close(patched, reference, rtol=exact, atol=exact)
    torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-6, atol=1e-6)


def test_cached_generation_equals_the_plain_models(family) -> None:
    _, model, pg, ids = family
    settings = {"max_new_tokens": 4, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad():
        assert torch.equal(pg.generate(ids[:1], **settings), model.generate(ids[:1], **settings))


def test_causal_tracing_equals_forward_hooks(family, tokenizer) -> None:
    """Every (kind, layer) cell at the last subject token equals the same restoration done with plain forward hooks:
    noise added to the subject's token embeddings, the clean state put back at one token."""
    _, model, pg, _ = family
    layout = detect_layout(pg)
    kinds = ["hidden", "mlp", "attn"]
    result = causal_trace(pg, tokenizer, PROMPT, SUBJECT, answer=ANSWER, samples=2, noise_std=0.5,
                          windows={"mlp": 1, "attn": 1}, kinds=kinds)
    ids = torch.tensor([result.token_ids])
    s0, s1 = result.subject_range
    noise = torch.randn(2, s1 - s0, pg.node(layout.embed).tensor_shape[-1],
                        generator=torch.Generator().manual_seed(result.seed)) * result.noise_level * 0.5
    embed = model.get_input_embeddings()
    token = s1 - 1
    for kind in kinds:
        for layer in range(result.num_layers):
            module = _block_module(model, layout, kind, layer)
            clean: dict[str, torch.Tensor] = {}
            with torch.no_grad(), _hooks((module, _record(clean, "v"))):
                model(ids, use_cache=False)

            def corrupt(t: torch.Tensor) -> torch.Tensor:
                out = t.clone()
                out[:, s0:s1] += noise
                return out

            def restore(t: torch.Tensor) -> torch.Tensor:
                out = t.clone()
                out[:, token] = clean["v"][0, token]
                return out

            with torch.no_grad(), _hooks((embed, corrupt), (module, restore)):
                logits = model(ids.expand(2, -1), use_cache=False).logits[:, -1]
            expected = torch.softmax(logits, -1)[:, result.answer_id].mean()
            torch.testing.assert_close(result.kinds[kind].scores[layer, token], expected, rtol=1e-5, atol=1e-5)


def test_node_attribution_equals_forward_hooks(family) -> None:
    """AtP of the ``mlp`` kind: (corrupted − clean contribution) · ∂(logit difference)/∂contribution, taken with
    plain forward hooks on the module whose output the layout names."""
    _, model, pg, ids = family
    layout = detect_layout(pg)
    g = torch.Generator().manual_seed(1)
    vocab = model.get_input_embeddings().weight.shape[0]
    batch = PromptBatch(ids, torch.randint(3, vocab, ids.shape, generator=g), torch.tensor([5, 6]),
                        torch.tensor([7, 8]))
    result = atp(pg, batch, "mlp", forward_kwargs={"use_cache": False})
    for layer in range(2):
        module = _block_module(model, layout, "mlp", layer)
        corrupted: dict[str, torch.Tensor] = {}
        with torch.no_grad(), _hooks((module, _record(corrupted, "v"))):
            model(batch.corrupted, use_cache=False)
        clean: dict[str, torch.Tensor] = {}

        def keep(t: torch.Tensor) -> torch.Tensor:  # a copy of the value, and a zero delta whose gradient is ∂M/∂a
            clean["v"], clean["delta"] = t.detach().clone(), torch.zeros_like(t, requires_grad=True)
            return t + clean["delta"]

        with _hooks((module, keep)):
            logits = model(batch.clean, use_cache=False).logits[:, -1]
        rows = torch.arange(2)
        (logits[rows, batch.answer] - logits[rows, batch.foil]).mean().backward()
        expected = ((corrupted["v"] - clean["v"]) * clean["delta"].grad).sum(-1).sum(0)
        got = torch.tensor([score.score for score in sorted(result.scores, key=lambda s: s.position)
                            if score.layer == layer])
        torch.testing.assert_close(got, expected.detach(), rtol=1e-5, atol=1e-6)


def test_a_spliced_sae_with_its_error_term_is_exact(family) -> None:
    _, model, pg, ids = family
    layout = detect_layout(pg)
    node = layout.path("mlp", 1)
    d = pg.node(node).tensor_shape[-1]
    sae = SparseAutoencoder(d, 2 * d, "topk", 4, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = pg(ids, use_cache=False).logits
        with pg.patch(splice(pg, sae, node)):
            spliced = pg(ids, use_cache=False).logits
    torch.testing.assert_close(spliced, plain, rtol=0, atol=1e-5)


def test_a_patch_at_the_router_logits_steers_the_expert_choice(family) -> None:
    """Mixture-of-experts families: the layout's router logits ``[tokens, n_experts]`` and expert choice
    ``[tokens, top_k]`` are nodes; raising one expert's logit everywhere makes every token choose it."""
    _, _, pg, ids = family
    layout = detect_layout(pg)
    if layout.router_logits is None:
        with pytest.raises(LayoutError, match="router_logits.*not a mixture of experts"):
            layout.path("router_logits", 0)
        return
    n_experts = pg.node(layout.path("router_logits", 0)).tensor_shape[-1]
    choice = ProbePatch()
    with torch.no_grad(), pg.patch({layout.path("expert_choice", 0): choice}):
        plain = pg(ids, use_cache=False).logits
    chosen = int(torch.bincount(choice.activation.flatten(), minlength=n_experts).argmin())  # the least chosen one
    boost = torch.zeros(n_experts)
    boost[chosen] = 1e3
    steered = ProbePatch()
    with torch.no_grad(), pg.patch({layout.path("router_logits", 0): AddPatch(value=boost),
                                    layout.path("expert_choice", 0): steered}):
        patched = pg(ids, use_cache=False).logits
    assert bool((steered.activation == chosen).any(dim=-1).all()) and not torch.equal(patched, plain)


def test_compiled_patched_logits_equal_eager(family) -> None:
    _, _, pg, ids = family
    layout = detect_layout(pg)
    patches = {layout.path("mlp", 0): AddPatch(value=torch.ones(pg.node(layout.embed).tensor_shape[-1]))}
    with torch.no_grad(), pg.patch(patches):
        eager = pg(ids, use_cache=False).logits
    pg.compile(backend="eager")  # the last test of each family (the module's fixture keeps the graph)
    with torch.no_grad(), pg.patch(patches), warnings.catch_warnings():
        warnings.simplefilter("error", CompilationWarning)  # compiled, not run eagerly after a dynamo error
        compiled = pg(ids, use_cache=False).logits
    torch.testing.assert_close(compiled, eager, rtol=1e-6, atol=1e-6)
