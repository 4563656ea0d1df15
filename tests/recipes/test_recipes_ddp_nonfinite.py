"""A non-finite loss on one DDP rank stops every rank at that step (2 CPU processes, gloo, tiny model).

Rank 1's model is given NaN weights before step 2, so only its loss is NaN. Without an agreement before the backward
pass, rank 0 would go on into the gradient all-reduce and wait for a rank that has stopped. ``timeout=`` on the
subprocess only turns such a hang into a failed test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent('''
    import json, os, sys
    import torch
    torch.set_num_threads(1)
    from lightning.pytorch import Callback, Trainer
    from recipes import DeltaModule, DeltaSpec, Objective, TargetSpec
    from recipes.testing import tiny_backbone

    class NaNOnRank1(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_rank == 1 and trainer.global_step == 2:
                pl_module.graph.wrapped_model.lm_head.weight.data.fill_(float("nan"))

    if __name__ == "__main__":
        module = DeltaModule.from_model(
            *tiny_backbone(), deltas=[DeltaSpec("model.layers_1.output", "last")],
            objective=Objective(targets=[TargetSpec("the city of", "Rome"),
                                         TargetSpec("the capital of France is", "Paris")]), lr=0.05)
        trainer = Trainer(max_steps=5, accelerator="cpu", devices=2, strategy="ddp", logger=False,
                          callbacks=[NaNOnRank1()], enable_checkpointing=False, enable_progress_bar=False,
                          enable_model_summary=False)
        rank = int(os.environ.get("LOCAL_RANK", "0"))
        record = {"rank": rank}
        try:
            trainer.fit(module)
        except Exception as error:
            record.update(error=type(error).__name__, message=str(error), step=trainer.global_step)
        with open(f"{sys.argv[1]}/rank{rank}.json", "w") as handle:
            json.dump(record, handle)
        sys.stdout.flush()
        sys.stderr.flush()
        # Leave without tearing the process group down: gloo's destroy_process_group on one rank was seen to wait
        # forever once the other rank had exited (the failure here is the step's, already recorded above).
        os._exit(0)
''')


def test_nan_loss_on_one_rank_stops_both_ranks_at_that_step(tmp_path):
    script = tmp_path / "fit_nan.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, str(script), str(tmp_path)], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    rank0 = json.loads((tmp_path / "rank0.json").read_text())
    assert rank0["error"] == "NonFiniteError" and rank0["step"] == 2
    assert "non-finite at step 2 on rank(s) [1]; every rank stops" in rank0["message"]
    rank1_file = tmp_path / "rank1.json"  # rank 1 may be ended by the launcher once rank 0 has raised
    if rank1_file.is_file():
        rank1 = json.loads(rank1_file.read_text())
        assert rank1["error"] == "NonFiniteError" and rank1["step"] == 2
        assert "'loss' is non-finite at step 2" in rank1["message"]
