"""DeviceMapStrategy: train deltas on a model that accelerate spread over several devices (``device_map="auto"``).

Lightning's strategies move the whole LightningModule to one device, which would gather a ``device_map`` model
onto a single GPU. This strategy leaves the frozen graph where accelerate put it and moves only the trainable
tensors (and the batches) to ``device``; each AddPatch casts its value to the device of the activation it is added
to, so a delta on ``cuda:0`` patches a layer on ``cuda:3`` (its gradient flows back through the copy)::

    model = AutoModelForCausalLM.from_pretrained(path, device_map="auto", dtype=torch.bfloat16).eval()
    module = DeltaModule.from_model(model, tokenizer, deltas=[...], objective=...)
    Trainer(accelerator="gpu", devices=1, strategy=DeviceMapStrategy("cuda:0"), max_steps=50).fit(module)
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.strategies import SingleDeviceStrategy

from .training.frozen import FrozenGraphModule

__all__ = ["DeviceMapStrategy"]


class DeviceMapStrategy(SingleDeviceStrategy):
    """Single-process strategy that does not move a FrozenGraphModule's graph.

    Args:
        device: where the trainable tensors, the optimizer state and the batches live; use the device of the
            model's input embeddings (``model.get_input_embeddings().weight.device``), ``"cuda:0"`` for
            ``device_map="auto"``.
        kwargs: the other arguments of :class:`~lightning.pytorch.strategies.SingleDeviceStrategy`.
    """

    strategy_name = "device_map"

    def __init__(self, device: str | torch.device = "cuda:0", **kwargs: Any) -> None:
        super().__init__(device=device, **kwargs)

    def model_to_device(self) -> None:
        """Move the trainable tensors (and buffers outside the graph) to ``device``; leave the graph in place.

        Raises:
            TypeError: the LightningModule is not a FrozenGraphModule (use Lightning's own strategies).
        """
        module = self.lightning_module
        if not isinstance(module, FrozenGraphModule):
            raise TypeError(f"DeviceMapStrategy trains FrozenGraphModules (DeltaModule, ObjectiveModule), got "
                            f"{type(module).__name__}; use strategy='auto' for other modules")
        device = self.root_device
        with torch.no_grad():
            for parameter in module.trainable_parameters():
                parameter.data = parameter.data.to(device)
            in_graph = {id(sub) for sub in module.graph.modules()}
            for owner in module.modules():
                if id(owner) in in_graph:
                    continue
                for name, buffer in list(owner.named_buffers(recurse=False)):
                    setattr(owner, name, buffer.to(device))  # a registered buffer stays one (persistence kept)

    def teardown(self) -> None:
        """Lightning's teardown without moving the module to the CPU (which would gather the whole model there):
        only the optimizer state goes to the CPU."""
        module = self.lightning_module
        if module is None:
            super().teardown()
            return
        module.cpu = lambda: module  # type: ignore[method-assign]
        try:
            super().teardown()
        finally:
            del module.cpu
