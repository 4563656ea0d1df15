"""ObjectiveModule: the extension point for objectives with their own patches (ROME's value step)."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import Trainer

from gradpatch import AddPatch, PatchableGraph
from recipes import ObjectiveModule, RecipeConfigError
from recipes.testing import tiny_backbone


def trainer(max_steps: int) -> Trainer:
    return Trainer(max_steps=max_steps, accelerator="cpu", logger=False, enable_checkpointing=False,
                   enable_progress_bar=False, enable_model_summary=False)


@pytest.fixture
def graph_and_ids():
    torch.set_num_threads(1)
    model, _ = tiny_backbone()
    ids = torch.tensor([[3, 14, 6], [3, 17, 6]])
    return PatchableGraph(model, ids, use_cache=False), ids


def test_optimises_a_delta_with_a_per_row_index_patch(graph_and_ids):
    pg, ids = graph_and_ids
    index = (torch.tensor([0, 1]), torch.tensor([2, 1]))  # a different token per row, as ROME's subject positions

    def objective(values):
        with pg.patch({"model.layers_1.output": AddPatch(value=values["delta"], slice=index)}):
            logits = pg(ids, use_cache=False).logits
        nll = torch.nn.functional.cross_entropy(logits[:, -1], torch.tensor([23, 23]))
        return {"loss": nll, "nll": nll}

    module = ObjectiveModule(pg, {"delta": torch.zeros(64)}, objective, lr=0.1,
                             project=lambda values: values["delta"].clamp_(-0.5, 0.5))
    before = objective(module.values)["loss"].item()
    trainer(10).fit(module)
    assert objective(module.values)["loss"].item() < before - 0.5
    assert module.values["delta"].abs().max().item() <= 0.5
    assert not any(p.requires_grad for p in pg.parameters())
    assert [name for name, _ in module.named_parameters() if not name.startswith("pg.")] == ["values.delta"]


def test_early_stop_skips_the_update(graph_and_ids):
    pg, _ = graph_and_ids
    target = torch.full((8,), 2.0)

    def objective(values):
        return {"loss": (values["x"] - target).pow(2).mean()}

    module = ObjectiveModule(pg, {"x": torch.zeros(8)}, objective, lr=0.5, optimizer="sgd", early_stop_loss=0.05)
    fit = trainer(100)
    fit.fit(module)
    assert module.stopped_early and fit.global_step < 100
    assert objective(module.values)["loss"].item() < 0.05


def test_objective_must_return_a_loss(graph_and_ids):
    pg, _ = graph_and_ids
    module = ObjectiveModule(pg, {"x": torch.zeros(2)}, lambda values: {"nll": values["x"].sum()})
    with pytest.raises(RecipeConfigError, match="'loss'"):
        trainer(1).fit(module)
