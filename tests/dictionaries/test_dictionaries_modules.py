"""Sparse dictionaries as modules: forwards against their equations written out, JumpReLU's straight-through
gradients against the paper's analytic values, BatchTopK, the local losses, and bad configurations."""

from __future__ import annotations

import pytest
import torch

from gradpatch.dictionaries import (DictionaryConfig, DictionaryConfigError, DictionaryShapeError, SkipTranscoder,
                                    SparseAutoencoder, SparseDictionary, Transcoder, auxk_loss, jumprelu, jumprelu_l0,
                                    l1_penalty, normalized_mse, remove_parallel_gradient, unit_norm_rows)


def _randomise(dictionary: SparseDictionary, seed: int = 0) -> SparseDictionary:
    """Every parameter drawn at random (biases included), so no term of the equations is zero."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in dictionary.named_parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=g) * (0.1 if name == "threshold" else 0.5))
    return dictionary


def test_topk_forward_equals_the_equations_written_out() -> None:
    sae = _randomise(SparseAutoencoder(12, 40, "topk", k=5))
    x = torch.randn(3, 4, 12, generator=torch.Generator().manual_seed(1))
    expected = torch.empty_like(x)
    for token in range(12):  # one token at a time: h = W_encᵀ(x − b_pre) + b_enc, keep the 5 largest, ReLU, decode
        b, s = divmod(token, 4)
        h = sae.W_enc.T @ (x[b, s] - sae.b_dec) + sae.b_enc
        kth = sorted(h.tolist(), reverse=True)[4]
        z = torch.where(h >= kth, torch.clamp(h, min=0), torch.zeros_like(h))
        expected[b, s] = sae.W_dec.T @ z + sae.b_dec
    assert int((sae.encode(x) != 0).sum(-1).max()) <= 5
    assert (sae(x) - expected).abs().max() < 1e-6


def test_relu_jumprelu_and_skip_transcoder_forwards() -> None:
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(2))
    relu = _randomise(SparseAutoencoder(6, 10, "relu", apply_b_dec_to_input=False))
    assert torch.allclose(relu(x), torch.relu(x @ relu.W_enc + relu.b_enc) @ relu.W_dec + relu.b_dec, atol=1e-6)
    jump = _randomise(SparseAutoencoder(6, 10, "jumprelu"))
    h = (x - jump.b_dec) @ jump.W_enc + jump.b_enc
    assert torch.allclose(jump.encode(x), h * (h > jump.threshold), atol=1e-6)
    skip = _randomise(SkipTranscoder(6, 10, 4, "relu"))
    expected = torch.relu(x @ skip.W_enc + skip.b_enc) @ skip.W_dec + skip.b_dec + x @ skip.W_skip.T
    assert skip(x).shape == (5, 4) and torch.allclose(skip(x), expected, atol=1e-6)


def test_jumprelu_threshold_gets_the_papers_straight_through_gradient() -> None:
    """Rajamanoharan et al. 2024, eq. 11: ∂z/∂θ = −(θ/ε) K((h − θ)/ε), K = 1[|u| < ½]; ∂z/∂h = H(h − θ)."""
    eps = 0.1
    theta = torch.tensor([0.5, 1.0], requires_grad=True)
    h = torch.tensor([[0.52, 0.97], [0.60, 1.04], [0.47, 0.20]], requires_grad=True)
    g = torch.tensor([[1.0, 2.0], [3.0, -1.0], [0.5, 4.0]])
    (jumprelu(h, theta, eps) * g).sum().backward()
    # latent 0: tokens 0 (|0.02| < 0.05) and 2 (|−0.03| < 0.05) in the window; latent 1: tokens 0 and 1
    expected_theta = torch.tensor([-(0.5 / eps) * (1.0 + 0.5), -(1.0 / eps) * (2.0 - 1.0)])
    assert torch.allclose(theta.grad, expected_theta)
    assert torch.equal(h.grad, g * torch.tensor([[1.0, 0.0], [1.0, 1.0], [0.0, 0.0]]))
    theta.grad = None
    jumprelu_l0(h.detach(), theta, eps).backward()  # eq. 12: −(1/ε) K(...), averaged over the 3 tokens
    assert torch.allclose(theta.grad, torch.tensor([-(1 / eps) * 2 / 3, -(1 / eps) * 2 / 3]))


def test_jumprelu_sae_threshold_gradient_through_the_module() -> None:
    sae = SparseAutoencoder(2, 2, "jumprelu", apply_b_dec_to_input=False, bandwidth=0.2)
    with torch.no_grad():
        sae.W_enc.copy_(torch.eye(2))
        sae.threshold.copy_(torch.tensor([0.3, 0.6]))
    x = torch.tensor([[0.35, 0.1], [0.9, 0.65]])  # h = x: (0.35 − 0.3)/0.2 and (0.65 − 0.6)/0.2 in the window
    sae.encode(x).sum().backward()
    assert torch.allclose(sae.threshold.grad, torch.tensor([-(0.3 / 0.2), -(0.6 / 0.2)]))


def test_batchtopk_keeps_k_per_token_on_average_and_evaluates_with_its_threshold() -> None:
    sae = _randomise(SparseAutoencoder(8, 32, "batchtopk", k=3)).train()
    x = torch.randn(10, 8, generator=torch.Generator().manual_seed(3))
    z = sae.encode(x)
    assert int((z != 0).sum()) == 30 and int((z != 0).sum(-1).max()) > 0
    assert float(sae.batch_threshold) > 0
    sae.eval()
    h = sae.pre_activations(x)
    assert torch.equal(sae.encode(x), h * (h > sae.batch_threshold))
    # a token's latents no longer depend on the rest of its batch
    assert torch.allclose(sae.encode(x[:1]), sae.encode(x)[:1], atol=1e-6)


def test_losses() -> None:
    g = torch.Generator().manual_seed(4)
    x = torch.randn(20, 6, generator=g)
    assert torch.allclose(normalized_mse(x.mean(0).expand_as(x), x), torch.tensor(1.0))
    assert float(normalized_mse(x, x)) == 0.0
    W_dec = unit_norm_rows(torch.randn(16, 6, generator=g))  # noqa: N806
    assert torch.allclose(W_dec.norm(dim=-1), torch.ones(16))
    grad = remove_parallel_gradient(W_dec, torch.randn(16, 6, generator=g))
    assert (grad * W_dec).sum(-1).abs().max() < 1e-6
    z = torch.randn(20, 16, generator=g)
    assert torch.allclose(l1_penalty(z, 2 * W_dec), 2 * z.abs().sum(-1).mean())
    h, residual = torch.randn(20, 16, generator=g), torch.randn(20, 6, generator=g)
    assert float(auxk_loss(h, residual, W_dec, torch.zeros(16, dtype=torch.bool), 4)) == 0.0
    dead = torch.zeros(16, dtype=torch.bool)
    dead[[1, 5]] = True
    estimate = torch.zeros(20, 16)
    estimate[:, [1, 5]] = h[:, [1, 5]].relu()  # k_aux = 4 > 2 dead: both dead latents, scale 2/4
    expected = 0.5 * normalized_mse(estimate @ W_dec, residual)
    assert torch.allclose(auxk_loss(h, residual, W_dec, dead, 4), expected)


def test_config_round_trip_and_bad_configurations() -> None:
    config = Transcoder(8, 16, 4, "topk", k=2, input_node="a", output_node="b").config
    assert DictionaryConfig.from_dict(config.to_dict()) == config
    assert type(SparseDictionary.from_config(config)) is Transcoder
    with pytest.raises(DictionaryConfigError, match="k in 1..d_sae"):
        SparseAutoencoder(8, 16, "topk")
    with pytest.raises(DictionaryConfigError, match="activation 'gelu'"):
        SparseAutoencoder(8, 16, "gelu")
    with pytest.raises(DictionaryConfigError, match="applies to topk"):
        SparseAutoencoder(8, 16, "relu", k=3)
    with pytest.raises(DictionaryConfigError, match="unknown dictionary config fields"):
        DictionaryConfig.from_dict({**config.to_dict(), "colour": 1})
    with pytest.raises(DictionaryShapeError, match="last dimension 7"):
        SparseAutoencoder(8, 16, "relu")(torch.zeros(2, 7))


def test_auxk_loss_normalised_by_the_target_variance_as_sparsify() -> None:
    """``target`` given: Σ‖ê − e‖² / Σ‖y − mean(y)‖² (sparsify's divisor) instead of the residual's variance."""
    g = torch.Generator().manual_seed(5)
    h, target = torch.randn(20, 16, generator=g), torch.randn(20, 6, generator=g)
    residual = 0.1 * torch.randn(20, 6, generator=g)
    W_dec = unit_norm_rows(torch.randn(16, 6, generator=g))  # noqa: N806
    dead = torch.zeros(16, dtype=torch.bool)
    dead[[1, 5]] = True
    estimate = torch.zeros(20, 16)
    estimate[:, [1, 5]] = h[:, [1, 5]].relu()
    error = (estimate @ W_dec - residual).pow(2).sum()
    expected = 0.5 * error / (target - target.mean(0)).pow(2).sum()
    assert torch.allclose(auxk_loss(h, residual, W_dec, dead, 4, target=target), expected)
    by_residual = auxk_loss(h, residual, W_dec, dead, 4)  # the default, Gao et al.'s: ~100× here (|e| ≈ 0.1 |y|)
    assert torch.allclose(by_residual, 0.5 * error / (residual - residual.mean(0)).pow(2).sum())
    with pytest.raises(ValueError, match="target"):
        auxk_loss(h, residual, W_dec, dead, 4, target=target[:5])


def test_apply_b_dec_to_input_has_one_default() -> None:
    """One default: an SAE subtracts b_dec before encoding (Gao et al.'s b_pre) whether built as a class or from a
    config; a transcoder never does; an explicit value is kept through a round trip."""
    built = SparseAutoencoder(8, 16, "topk", k=2).config
    assert built.apply_b_dec_to_input is True
    assert DictionaryConfig("sae", "topk", 8, 16, k=2).apply_b_dec_to_input is True
    assert DictionaryConfig("transcoder", "topk", 8, 16, k=2).apply_b_dec_to_input is False
    assert Transcoder(8, 16, activation="relu").config.apply_b_dec_to_input is False
    fields = {key: value for key, value in built.to_dict().items() if key != "apply_b_dec_to_input"}
    assert DictionaryConfig.from_dict(fields).apply_b_dec_to_input is True
    explicit = SparseAutoencoder(8, 16, "relu", apply_b_dec_to_input=False).config
    assert DictionaryConfig.from_dict(explicit.to_dict()).apply_b_dec_to_input is False
