"""ShardedFrozenDDPStrategy: train patches under DDP while FSDP2 shards the frozen model over the ranks.

A FrozenGraphModule (:class:`~recipes.delta.DeltaModule`, :class:`~recipes.training.ObjectiveModule`) has two
kinds of tensors: the frozen model, large and never updated, and a few trainable patch tensors. This strategy is
Lightning's ``ddp`` (its launcher, process group and gradient all-reduce for the patches, which stay replicated)
plus torch's FSDP2 ``fully_shard`` on the frozen model: each decoder block's weights are split over the ranks and
all-gathered for the block's forward (and again for its backward, which the patches' gradients flow through), then
freed. Per rank the model takes ``1/W`` of its memory between blocks.

Why not Lightning's ``ModelParallelStrategy`` alone: it syncs only the gradients of parameters inside
``fully_shard`` units, so replicated patches would drift apart; here DDP keeps them equal (the frozen weights are
in ``_ddp_params_and_buffers_to_ignore``, so DDP neither broadcasts nor syncs them).

::

    module = DeltaModule.from_model(model, tokenizer, deltas=[...], objective=...)
    Trainer(accelerator="gpu", devices=8, strategy=ShardedFrozenDDPStrategy(), max_steps=50).fit(module)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning.pytorch.strategies import DDPStrategy
from torch import nn

from .errors import RecipeConfigError
from .training.frozen import FrozenGraphModule

__all__ = ["ShardedFrozenDDPStrategy", "decoder_blocks"]


def decoder_blocks(model: nn.Module) -> list[nn.Module]:
    """The entries of the model's largest ``nn.ModuleList`` (a transformer's decoder layers, e.g.
    ``model.model.layers``): the units FSDP2 shards one by one.

    Raises:
        RecipeConfigError: the model has no ``nn.ModuleList`` (pass ``blocks=`` to the strategy).
    """
    lists = [module for module in model.modules() if isinstance(module, nn.ModuleList)]
    if not lists:
        raise RecipeConfigError(f"{type(model).__name__} has no nn.ModuleList of blocks to shard; pass "
                                "ShardedFrozenDDPStrategy(blocks=lambda model: [...the modules to shard...])")
    return list(max(lists, key=len))


class ShardedFrozenDDPStrategy(DDPStrategy):
    """Lightning's DDP for the trainable patches, FSDP2 ``fully_shard`` for the frozen model (see the module docstring).

    Args:
        blocks: the frozen model's modules to shard one by one (default :func:`decoder_blocks`); the model itself is
            sharded last, as the root unit (embeddings, final norm, head).
        kwargs: the other arguments of :class:`~lightning.pytorch.strategies.DDPStrategy`.
    """

    strategy_name = "ddp_sharded_frozen"

    def __init__(self, blocks: Callable[[nn.Module], list[nn.Module]] = decoder_blocks, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.blocks = blocks

    def model_to_device(self) -> None:
        """Shard the frozen model over the ranks (each shard goes to this rank's device), then move the rest.

        Raises:
            TypeError: the LightningModule is not a FrozenGraphModule.
        """
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        module = self.lightning_module
        if not isinstance(module, FrozenGraphModule):
            raise TypeError(f"ShardedFrozenDDPStrategy trains FrozenGraphModules (DeltaModule, ObjectiveModule), got "
                            f"{type(module).__name__}; use strategy='fsdp' for other modules")
        model = module.graph.wrapped_model
        mesh = init_device_mesh(self.root_device.type, (self.world_size,))
        for block in self.blocks(model):
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        super().model_to_device()
