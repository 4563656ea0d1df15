"""evaluate_dictionary on the tiny Llama: SAELens's metrics against the same quantities computed by hand (through
gradpatch's patches, and through plain forward hooks on the Hugging Face model), and a dictionary that reconstructs
exactly."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from gradpatch import PatchableGraph, ProbePatch, ZeroPatch, testing
from gradpatch.dictionaries import SAELENS_NAMES, SparseAutoencoder, Transcoder, evaluate_dictionary, splice

BATCHES = [testing.random_prompt_batch(seed=seed).clean for seed in (1, 2)]  # two batches [3, 6]
NODE = "model.layers_0.output"


def _ce(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(), reduction="sum")


def test_metrics_equal_the_definitions_computed_by_hand(llama_graph) -> None:
    sae = SparseAutoencoder(64, 128, "topk", k=4, node=NODE, generator=torch.Generator().manual_seed(0))
    metrics = evaluate_dictionary(llama_graph, sae, BATCHES)
    xs, sums, kl = [], {"original": 0.0, "spliced": 0.0, "zero": 0.0}, 0.0
    with torch.no_grad():
        for ids in BATCHES:
            probe = ProbePatch()
            with llama_graph.patch({NODE: probe}):
                original = llama_graph(ids).logits
            with llama_graph.patch(splice(llama_graph, sae, NODE, error_term=False)):
                spliced = llama_graph(ids).logits
            with llama_graph.patch({NODE: ZeroPatch()}):
                zero = llama_graph(ids).logits
            xs.append(probe.activation.reshape(-1, 64))
            for name, logits in (("original", original), ("spliced", spliced), ("zero", zero)):
                sums[name] += float(_ce(logits, ids))
            p, q = original.log_softmax(-1), spliced.log_softmax(-1)
            kl += float((p.exp() * (p - q)).sum())
        x = torch.cat(xs)
        z = sae.encode(x)
        fvu = float((x - sae(x)).pow(2).sum() / (x - x.mean(0)).pow(2).sum())
    positions = 2 * 3 * 5
    ce = {name: value / positions for name, value in sums.items()}
    assert metrics.n_tokens == 36
    assert math.isclose(metrics.fvu, fvu, rel_tol=1e-5) and math.isclose(metrics.explained_variance, 1 - fvu,
                                                                          rel_tol=1e-5)
    assert math.isclose(metrics.l0, 4.0) and math.isclose(metrics.dead_fraction, float((z == 0).all(0).float().mean()))
    for name in ce:
        assert math.isclose(getattr(metrics, f"ce_loss_{'zero_ablation' if name == 'zero' else name}"), ce[name],
                            rel_tol=1e-5)
    assert math.isclose(metrics.kl, kl / 36, rel_tol=1e-4)
    assert set(metrics.to_dict()) == {"fvu", "explained_variance", "l0", "dead_fraction", "ce_loss_original",
                                      "ce_loss_spliced", "ce_loss_zero_ablation", "ce_loss_recovered", "kl",
                                      "n_tokens", *SAELENS_NAMES}
    for saelens, ours in SAELENS_NAMES.items():  # SAELens's names are the same numbers
        assert metrics.to_dict()[saelens] == metrics.to_dict()[ours]


def _hooked_losses(model: torch.nn.Module, replace: Callable[[torch.Tensor], torch.Tensor] | None,
                   first: int = 0) -> tuple[float, torch.Tensor]:
    """Without gradpatch: the summed next-token CE over :data:`BATCHES` and their log-probabilities ``[2, 3, 6,
    vocab]``, with layer 0's output hidden states at positions ``first..`` replaced by ``replace`` (a plain forward
    hook on the Hugging Face module; ``None``: the model as it is)."""
    def hook(module: torch.nn.Module, inputs: Any, output: Any) -> Any:
        hidden = output[0] if isinstance(output, tuple) else output
        hidden = torch.cat([hidden[:, :first], replace(hidden[:, first:])], dim=1)
        return (hidden, *output[1:]) if isinstance(output, tuple) else hidden

    handle = model.model.layers[0].register_forward_hook(hook) if replace is not None else None
    try:
        with torch.no_grad():
            logits = torch.stack([model(ids).logits for ids in BATCHES])
    finally:
        if handle is not None:
            handle.remove()
    ce = sum(float(_ce(batch_logits, ids)) for batch_logits, ids in zip(logits, BATCHES))
    return ce, logits.log_softmax(-1)


def test_ce_loss_recovered_equals_a_splice_by_forward_hooks() -> None:
    """CE loss recovered against the same quantities computed with plain forward hooks on a tiny Llama whose
    next-token CE is far from ln 100 (initialisation 0.3), so that the ratio is well conditioned."""
    model = testing.tiny_llama(100, hidden=64, intermediate=128, init_std=0.3, max_position_embeddings=128,
                               pad_token_id=None, bos_token_id=1, eos_token_id=2)
    pg = PatchableGraph(model, BATCHES[0], use_cache=False)
    sae = SparseAutoencoder(64, 128, "topk", k=1, node=NODE, generator=torch.Generator().manual_seed(0))
    metrics = evaluate_dictionary(pg, sae, BATCHES)
    original, _ = _hooked_losses(model, None)
    spliced, _ = _hooked_losses(model, sae)
    zero, _ = _hooked_losses(model, torch.zeros_like)
    recovered = (zero - spliced) / (zero - original)
    assert abs(zero - original) > 1 and 0.5 < recovered < 0.99  # a ratio the test can tell from 0, 1 or its inverse
    assert math.isclose(metrics.ce_loss_recovered, recovered, rel_tol=1e-5)


def test_kl_averages_over_every_position_with_excluded_first_positions() -> None:
    """With ``exclude_first_positions`` 2 the KL is averaged over every position (the first two, unspliced, add 0
    to its sum), as the CE losses are, not over the positions the activation metrics count."""
    model = testing.tiny_llama(100, hidden=64, intermediate=128, init_std=0.3, max_position_embeddings=128,
                               pad_token_id=None, bos_token_id=1, eos_token_id=2)
    pg = PatchableGraph(model, BATCHES[0], use_cache=False)
    sae = SparseAutoencoder(64, 128, "topk", k=4, node=NODE, exclude_first_positions=2,
                            generator=torch.Generator().manual_seed(0))
    metrics = evaluate_dictionary(pg, sae, BATCHES)
    _, p = _hooked_losses(model, None)
    _, q = _hooked_losses(model, sae, first=2)
    kl = (p.exp() * (p - q)).sum(-1)  # [2, 3, 6]
    assert float(kl[..., :2].abs().max()) < 1e-6 and metrics.n_tokens == 2 * 3 * 4
    assert math.isclose(metrics.kl, float(kl.mean()), rel_tol=1e-4)


def test_an_exact_dictionary_recovers_all_of_the_loss(llama_graph) -> None:
    """ReLU latents [x, −x] decoded by [I; −I]: x̂ = ReLU(x) − ReLU(−x) = x."""
    exact = SparseAutoencoder(64, 128, "relu", node=NODE, apply_b_dec_to_input=False)
    with torch.no_grad():
        exact.W_enc.copy_(torch.cat([torch.eye(64), -torch.eye(64)], dim=1))
        exact.W_dec.copy_(torch.cat([torch.eye(64), -torch.eye(64)]))
    metrics = evaluate_dictionary(llama_graph, exact, BATCHES)
    assert metrics.fvu < 1e-10 and abs(metrics.kl) < 1e-6 and math.isclose(metrics.ce_loss_recovered, 1.0,
                                                                             abs_tol=1e-5)
    assert metrics.dead_fraction == 0.0 and math.isclose(metrics.l0, 64.0)


def test_transcoder_metrics_read_the_output_node(llama_graph) -> None:
    transcoder = Transcoder(64, 96, activation="relu", input_node="model.layers_0.mlp.x",
                            output_node="model.layers_0.mlp.output")
    metrics = evaluate_dictionary(llama_graph, transcoder, BATCHES[:1])
    probes = {"model.layers_0.mlp.x": ProbePatch(), "model.layers_0.mlp.output": ProbePatch()}
    with torch.no_grad(), llama_graph.patch(probes):
        llama_graph(BATCHES[0])
    x, y = (probe.activation.reshape(-1, 64) for probe in probes.values())
    with torch.no_grad():
        fvu = float((y - transcoder(x)).pow(2).sum() / (y - y.mean(0)).pow(2).sum())
    assert math.isclose(metrics.fvu, fvu, rel_tol=1e-5) and metrics.n_tokens == 18


def test_evaluation_extracts_a_new_class_of_sizes_without_a_warning(tiny_llama, llama_graph) -> None:
    """A fit trains on batches of several rows and evaluates one document at a time: the one-row calls are a new
    class of sizes, whose graphs the evaluation extracts itself (``pg.prepare``) without the warning meant for a
    user's own calls; the metrics are those of the same evaluation without that earlier call."""
    sae = SparseAutoencoder(64, 128, "topk", k=4, node=NODE, generator=torch.Generator().manual_seed(0))
    one_row = [BATCHES[0][:1]]
    expected = evaluate_dictionary(PatchableGraph(tiny_llama, one_row[0], use_cache=False), sae, one_row)
    with torch.no_grad():
        llama_graph(BATCHES[0], use_cache=False)  # three rows first, as a fit's training does
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        metrics = evaluate_dictionary(llama_graph, sae, one_row)
    assert metrics.to_dict() == expected.to_dict()
