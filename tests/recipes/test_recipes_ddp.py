"""DeltaModule runs unchanged under Lightning's `ddp` strategy: 2 CPU processes, gloo backend, tiny model.

The script is started in a subprocess because Lightning's `ddp` launcher re-runs the script for rank 1. With two
one-token targets and full-batch steps, each process takes one row; the averaged gradient equals the single-process
full-batch gradient, so both ranks end with the delta a single process trains.
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
    from recipes import DeltaModule, DeltaSpec, Objective, TargetSpec
    from recipes.testing import tiny_backbone

    class Rows(Callback):
        def __init__(self):
            self.rows = []
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            assert not pl_module.graph.training and not any(m.training for m in pl_module.model.modules())
            self.rows.append(batch["input_ids"].tolist())

    def fit(strategy, devices):
        module = DeltaModule.from_model(
            *tiny_backbone(), deltas=[DeltaSpec("model.layers_1.output", "last")],
            objective=Objective(targets=[TargetSpec("the city of", "Rome"),
                                         TargetSpec("the capital of France is", "Paris")]),
            lr=0.05)
        rows = Rows()
        trainer = Trainer(max_steps=5, accelerator="cpu", devices=devices, strategy=strategy, logger=False,
                          callbacks=[rows], enable_checkpointing=False, enable_progress_bar=False,
                          enable_model_summary=False)
        trainer.fit(module)
        return {"world_size": trainer.world_size, "rank": trainer.global_rank, "rows": rows.rows,
                "delta": module.deltas[0].detach().clone(),
                "frozen": not any(p.requires_grad for p in module.graph.parameters()),
                "process_group": getattr(trainer.strategy, "process_group_backend", None)}

    if __name__ == "__main__":
        result = fit("ddp", 2)
        torch.save(result, f"{sys.argv[1]}/ddp-rank{result['rank']}.pt")
        # As every DDP script should (Lightning destroys only NCCL groups at exit): a gloo group left alive can abort
        # the process at interpreter exit ("terminate called without an active exception").
        torch.distributed.destroy_process_group()
''')


def test_ddp_two_cpu_processes_match_one_process(tmp_path):
    script = tmp_path / "fit_ddp.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, str(script), str(tmp_path)], cwd=tmp_path, env=env,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    rank0, rank1 = torch.load(tmp_path / "ddp-rank0.pt"), torch.load(tmp_path / "ddp-rank1.pt")
    namespace: dict = {"__name__": "single"}
    exec(compile(SCRIPT, str(script), "exec"), namespace)
    single = namespace["fit"]("auto", 1)

    assert rank0["world_size"] == rank1["world_size"] == 2 and rank0["process_group"] == "gloo"
    assert rank0["frozen"] and rank1["frozen"]
    # Each process saw its own row at every step; the single process saw both.
    assert len(rank0["rows"]) == len(rank1["rows"]) == len(single["rows"]) == 5
    assert {len(batch) for batch in rank0["rows"] + rank1["rows"]} == {1}
    assert sorted(rank0["rows"][0] + rank1["rows"][0], key=len) == sorted(
        [[t for t in row if t != 0] for row in single["rows"][0]], key=len)
    # Gradients were all-reduced: identical deltas on both ranks, equal to the single-process delta.
    assert torch.equal(rank0["delta"], rank1["delta"])
    assert rank0["delta"].norm() > 0.1
    torch.testing.assert_close(rank0["delta"], single["delta"], atol=1e-5, rtol=1e-5)
