"""evaluate_dictionary on the tiny Llama: SAELens's metrics against the same quantities computed by hand, and a
dictionary that reconstructs exactly."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from gradpatch import ProbePatch, ZeroPatch, testing
from gradpatch.dictionaries import SparseAutoencoder, Transcoder, evaluate_dictionary, splice

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
    recovered = (metrics.ce_loss_zero_ablation - metrics.ce_loss_spliced) / (metrics.ce_loss_zero_ablation
                                                                             - metrics.ce_loss_original)
    assert metrics.ce_loss_recovered == recovered  # the CEs are close to ln 100 here, so only the formula is compared
    assert math.isclose(metrics.kl, kl / 36, rel_tol=1e-4)
    assert set(metrics.to_dict()) == {"fvu", "explained_variance", "l0", "dead_fraction", "ce_loss_original",
                                      "ce_loss_spliced", "ce_loss_zero_ablation", "ce_loss_recovered", "kl",
                                      "n_tokens"}


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
