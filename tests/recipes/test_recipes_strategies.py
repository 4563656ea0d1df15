"""DeviceMapStrategy leaves the frozen graph where it is (accelerate device_map models) and trains the deltas."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer

from recipes import DeltaModule, DeltaSpec, Objective, TargetSpec
from recipes.strategies import DeviceMapStrategy
from recipes.testing import tiny_backbone


def test_graph_is_never_moved_and_deltas_train(monkeypatch):
    torch.set_num_threads(1)
    module = DeltaModule.from_model(*tiny_backbone(), deltas=[DeltaSpec("model.layers_1.output", "last")],
                                    objective=Objective(targets=[TargetSpec("the city of", "Rome")]), lr=0.1)
    moves: list[str] = []
    original_apply = type(module.graph)._apply

    def spy(self, fn, recurse=True):
        moves.append(type(self).__name__)
        return original_apply(self, fn, recurse)

    monkeypatch.setattr(type(module.graph), "_apply", spy)
    trainer = Trainer(max_steps=3, accelerator="cpu", strategy=DeviceMapStrategy("cpu"), logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module)
    assert moves == []  # neither model_to_device nor teardown touched the graph
    assert module.deltas[0].abs().sum() > 0


def test_other_modules_are_refused():
    class Plain(LightningModule):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))

    strategy = DeviceMapStrategy("cpu")
    strategy._lightning_module = Plain()
    with pytest.raises(TypeError, match="strategy='auto'"):
        strategy.model_to_device()
