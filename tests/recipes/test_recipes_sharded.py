"""DeltaModule under ShardedFrozenDDPStrategy: 2 CPU processes (gloo), the frozen tiny model sharded by FSDP2.

As in tests/recipes/test_recipes_ddp.py the script runs in a subprocess (Lightning's launcher re-runs it for rank 1), with
two one-token targets and full-batch steps, so each rank takes one row and the mean of the two ranks' losses is the
single process's loss. Checked: the model's weights are sharded (DTensors holding half of each matrix), the loss
curve and the trained delta equal one unsharded process's, and the sharded graph's patched forward equals the
unsharded model's. ``timeout=`` on the subprocess only turns a hang into a failed test.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent('''
    import sys
    import torch
    torch.set_num_threads(1)
    from lightning.pytorch import Callback, Trainer
    from gradpatch import AddPatch, PatchableGraph
    from recipes import DeltaModule, DeltaSpec, Objective, TargetSpec
    from recipes.sharded import ShardedFrozenDDPStrategy
    from recipes.testing import tiny_backbone

    PROBE = torch.tensor([[20, 21, 22, 23, 24, 25, 26]])

    class Losses(Callback):
        def __init__(self):
            self.losses = []
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.losses.append(float(outputs["loss"]))

    def fit(strategy, devices):
        module = DeltaModule.from_model(
            *tiny_backbone(), deltas=[DeltaSpec("model.layers_1.output", "last")],
            objective=Objective(targets=[TargetSpec("the city of", "Rome"),
                                         TargetSpec("the capital of France is", "Paris")]),
            lr=0.05)
        losses = Losses()
        trainer = Trainer(max_steps=5, accelerator="cpu", devices=devices, strategy=strategy, logger=False,
                          callbacks=[losses], enable_checkpointing=False, enable_progress_bar=False,
                          enable_model_summary=False)
        trainer.fit(module)
        delta = module.deltas[0].detach().clone()
        weight = module.graph.wrapped_model.model.layers[0].mlp.down_proj.weight
        with torch.no_grad(), module.graph.patch({"model.layers_1.output": AddPatch(value=delta)}):
            patched = module.graph(PROBE).logits  # every rank runs it: the sharded forward all-gathers
        return {"rank": trainer.global_rank, "world_size": trainer.world_size, "losses": losses.losses,
                "delta": delta, "patched": patched, "weight_type": type(weight).__name__,
                "local_shape": list(getattr(weight, "to_local", lambda: weight)().shape),
                "full_shape": list(weight.shape)}

    if __name__ == "__main__":
        result = fit(ShardedFrozenDDPStrategy(), 2)
        torch.save(result, f"{sys.argv[1]}/sharded-rank{result['rank']}.pt")
        torch.distributed.destroy_process_group()  # as in tests/recipes/test_recipes_ddp.py: no gloo group left at exit
''')


def test_sharded_frozen_model_trains_the_delta_one_process_trains(tmp_path):
    script = tmp_path / "fit_sharded.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, str(script), str(tmp_path)], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    rank0, rank1 = (torch.load(tmp_path / f"sharded-rank{r}.pt") for r in (0, 1))
    namespace: dict = {"__name__": "single"}
    exec(compile(SCRIPT, str(script), "exec"), namespace)
    single = namespace["fit"]("auto", 1)

    assert rank0["world_size"] == 2
    for rank in (rank0, rank1):  # each rank holds half of every sharded weight
        assert rank["weight_type"] == "DTensor" and rank["full_shape"] == [64, 128]
        assert rank["local_shape"] == [32, 128]
    assert single["weight_type"] == "Parameter"
    # The global loss (mean of the ranks' one-row losses) follows the single process's full-batch loss.
    assert len(rank0["losses"]) == len(single["losses"]) == 5
    mean_losses = [(a + b) / 2 for a, b in zip(rank0["losses"], rank1["losses"])]
    assert max(abs(a - b) for a, b in zip(mean_losses, single["losses"])) <= 1e-5
    assert single["losses"][-1] < single["losses"][0]
    # Gradients of the replicated delta were all-reduced: identical on both ranks, equal to one process's.
    assert torch.equal(rank0["delta"], rank1["delta"]) and rank0["delta"].norm() > 0.1
    torch.testing.assert_close(rank0["delta"], single["delta"], atol=1e-5, rtol=1e-5)
    # The sharded graph's patched forward equals the unsharded model's with the same delta.
    unsharded = namespace["tiny_backbone"]()[0]
    pg = namespace["PatchableGraph"](unsharded, namespace["PROBE"], use_cache=False, logits_to_keep=1)
    with torch.no_grad(), pg.patch({"model.layers_1.output": namespace["AddPatch"](value=rank0["delta"])}):
        expected = pg(namespace["PROBE"], use_cache=False, logits_to_keep=1).logits  # as DeltaModule calls it
    for rank in (rank0, rank1):
        torch.testing.assert_close(rank["patched"], expected, atol=1e-6, rtol=1e-6)
