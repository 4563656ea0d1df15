"""ROME's rank-one update (Meng et al. 2022, eq. 2) on toy layers: exactness, untouched directions, orientation."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from editors import Edit, resolve_layer
from editors.errors import LayerKindError, StatisticsError
from editors.solve import rank_one_factors, solve_second_moment


def _spd(d: int, seed: int) -> torch.Tensor:
    """A random symmetric positive definite ``[d, d]`` float64 matrix (a stand-in for ``E[k kᵀ]``)."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(4 * d, d, generator=g, dtype=torch.float64)
    return a.T @ a / (4 * d)


class ToyModel(nn.Module):
    """One plain ``nn.Linear`` between two other layers."""

    def __init__(self, d_in: int = 6, d_out: int = 4, dtype: torch.dtype = torch.float64) -> None:
        super().__init__()
        self.up = nn.Linear(3, d_in, dtype=dtype)
        self.proj = nn.Linear(d_in, d_out, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(torch.relu(self.up(x)))


def test_update_maps_key_to_value_exactly() -> None:
    torch.manual_seed(0)
    layer = nn.Linear(6, 4, dtype=torch.float64)
    c = _spd(6, 1)
    k_star, v_star = torch.randn(6, dtype=torch.float64), torch.randn(4, dtype=torch.float64)
    u, v = rank_one_factors(layer.weight, k_star, v_star, c)
    w_new = layer.weight.detach() + torch.outer(v, u)  # W' = W + v uᵀ
    assert torch.allclose(w_new @ k_star, v_star, atol=1e-12, rtol=0)
    # eq. 2 written out: W' = W + (v* - W k*)(C⁻¹k*)ᵀ / ((C⁻¹k*)ᵀ k*)
    c_inv_k = torch.linalg.solve(c, k_star)
    paper = layer.weight.detach() + torch.outer(v_star - layer.weight.detach() @ k_star, c_inv_k) / (c_inv_k @ k_star)
    assert torch.allclose(w_new, paper, atol=1e-12, rtol=0)


def test_keys_orthogonal_to_c_inverse_k_are_untouched() -> None:
    torch.manual_seed(0)
    layer = nn.Linear(6, 4, dtype=torch.float64)
    c = _spd(6, 2)
    k_star, v_star = torch.randn(6, dtype=torch.float64), torch.randn(4, dtype=torch.float64)
    u, v = rank_one_factors(layer.weight, k_star, v_star, c)
    c_inv_k = solve_second_moment(c, k_star)
    w_new = layer.weight.detach() + torch.outer(v, u)
    for _ in range(5):
        k = torch.randn(6, dtype=torch.float64)
        k = k - (k @ c_inv_k) / (c_inv_k @ c_inv_k) * c_inv_k  # now kᵀ C⁻¹ k* = 0
        assert abs(float(k @ c_inv_k)) < 1e-12
        assert torch.allclose(w_new @ k, layer.weight.detach() @ k, atol=1e-12, rtol=0)


def test_edit_on_plain_linear_in_a_patchable_graph() -> None:
    from gradpatch import PatchableGraph, ProbePatch

    torch.manual_seed(0)
    model = ToyModel().eval()
    pg = PatchableGraph(model, torch.randn(2, 3, dtype=torch.float64))
    layer = resolve_layer(pg, "proj")
    assert (layer.transposed, layer.input_name, layer.d_in, layer.d_out) == (False, "input", 6, 4)
    c = _spd(6, 3)
    k_star, v_star = torch.randn(6, dtype=torch.float64), torch.randn(4, dtype=torch.float64)
    u, v = rank_one_factors(layer.w(), k_star, v_star - layer.bias.detach(), c)
    edit = Edit(node="proj", u=u, v=v).apply(pg)
    assert torch.allclose(model.proj(k_star), v_star, atol=1e-12, rtol=0)  # W' k* + b = v*
    # Inputs flowing through the graph: the edited layer's output changed only along v.
    x = torch.randn(5, 3, dtype=torch.float64)
    probe = ProbePatch()
    with pg.patch({"proj.input": probe}):
        out = pg(x)
    keys = probe.activation
    expected = keys @ (layer.weight.detach().T) + layer.bias.detach()
    assert torch.allclose(out, expected, atol=1e-12)
    edit.restore(pg)


def test_conv1d_orientation_on_tiny_gpt2() -> None:
    from gradpatch import PatchableGraph
    from transformers.pytorch_utils import Conv1D

    from gradpatch.testing import tiny_gpt2

    model = tiny_gpt2(vocab_size=50)
    pg = PatchableGraph(model, torch.randint(0, 50, (2, 5)), use_cache=False)
    layer = resolve_layer(pg, "transformer.h_1.mlp.c_proj")
    assert isinstance(layer.module, Conv1D)
    assert layer.transposed and layer.input_name == "x"
    assert tuple(layer.weight.shape) == (layer.d_in, layer.d_out) == (128, 32)  # stored [in, out]
    assert layer.input_node == "transformer.h_1.mlp.c_proj.x"
    assert tuple(pg.graph.transformer.h_1.mlp.c_proj.x._shape)[-1] == layer.d_in
    c = _spd(layer.d_in, 4)
    k_star = torch.randn(layer.d_in, dtype=torch.float64)
    v_star = torch.randn(layer.d_out, dtype=torch.float64)
    w = layer.w().detach().to(torch.float64)  # [d_out, d_in] view of the [d_in, d_out] weight
    u, v = rank_one_factors(w, k_star, v_star, c)
    before = layer.weight.detach().clone()
    edit = Edit(node=layer.path, u=u, v=v).apply(pg)
    delta = layer.weight.detach() - before
    assert torch.allclose(delta, torch.outer(u, v).float(), atol=1e-6)  # stored as u vᵀ, [in, out]
    bias = layer.bias.detach()
    out = layer.module(k_star.float().view(1, 1, -1)).view(-1)  # Conv1D: x @ W + b
    assert torch.allclose(out - bias, v_star.float(), atol=1e-4)
    c_inv_k = solve_second_moment(c, k_star)
    k = torch.randn(layer.d_in, dtype=torch.float64)
    k = k - (k @ c_inv_k) / (c_inv_k @ c_inv_k) * c_inv_k
    out_k = layer.module(k.float().view(1, 1, -1)).view(-1)
    assert torch.allclose(out_k, k.float() @ before + bias, atol=1e-4)
    edit.restore(pg)
    assert torch.equal(layer.weight.detach(), before)


def test_errors_name_the_fix() -> None:
    model = ToyModel()
    with pytest.raises(LayerKindError, match="nn.Linear or GPT-2 Conv1D"):
        resolve_layer(model, "")
    with pytest.raises(KeyError, match="children"):
        resolve_layer(model, "nope")
    w = torch.randn(4, 6, dtype=torch.float64)
    with pytest.raises(StatisticsError, match="n_samples"):
        rank_one_factors(w, torch.randn(6, dtype=torch.float64), torch.randn(4, dtype=torch.float64),
                         torch.zeros(6, 6, dtype=torch.float64))
    with pytest.raises(ValueError, match="expected k"):
        rank_one_factors(w, torch.randn(5, dtype=torch.float64), torch.randn(4, dtype=torch.float64), _spd(6, 0))
