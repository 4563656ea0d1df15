"""Gradients flow through patch values; the frozen model's weights get none."""

from __future__ import annotations

import torch
from torch import nn

from gradpatch import AddPatch, Intervention, PatchableGraph


def _frozen(model: nn.Module) -> nn.Module:
    for parameter in model.parameters():
        parameter.requires_grad_(False)
        parameter.grad = None
    return model


def test_add_patch_value_gets_gradient(tiny_llama, token_ids):
    model = _frozen(tiny_llama)
    pg = PatchableGraph(model, token_ids, use_cache=False)
    delta = torch.zeros(64, requires_grad=True)
    with pg.patch({"model.layers_0.output": AddPatch(value=delta, slice=(slice(None), -1))}):
        pg(token_ids, use_cache=False).logits[:, -1, 5].sum().backward()
    assert delta.grad is not None and delta.grad.abs().sum() > 0
    assert all(parameter.grad is None for parameter in model.parameters())


def test_adam_lowers_a_loss_on_a_steering_delta(tiny_llama, token_ids):
    model = _frozen(tiny_llama)
    pg = PatchableGraph(model, token_ids, use_cache=False)
    intervention = Intervention({"model.layers_1.mlp.down_proj.output": AddPatch(value=torch.zeros(64))})
    assert [p.shape for p in intervention.parameters()] == [torch.Size([64])]
    optimizer = torch.optim.Adam(intervention.parameters(), lr=0.5)
    target = torch.full((token_ids.shape[0],), 7)
    losses = []
    for _ in range(50):
        optimizer.zero_grad()
        with pg.patch(intervention):
            logits = pg(token_ids, use_cache=False).logits[:, -1]
        loss = nn.functional.cross_entropy(logits, target)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.85 * losses[0]  # the tiny model's logits are bounded by its 0.02-scale weights
    assert all(parameter.grad is None for parameter in model.parameters())
    state = intervention.state_dict()
    assert list(state) == ["values.0"]
