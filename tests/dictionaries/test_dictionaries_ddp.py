"""Dictionary training under Lightning's ``ddp`` strategy: 2 CPU processes, gloo backend, tiny Llama.

The script runs in a subprocess (Lightning's launcher re-runs it for rank 1). End to end, the loss is the KL averaged
over each rank's tokens and DDP averages the ranks' gradients, so 2 ranks of 2 sequences step as 1 process of the 4
(the unit-norm projection of the decoder gradient is linear, so it commutes with the average): both ranks end with
the single process's SAE, given the sequences in the order Lightning's DistributedSampler deals them. Locally each
rank streams its own shard into its own buffer (the FVU is normalised per rank, so no single-process equal exists):
both ranks end with the same SAE, written once.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

from gradpatch.dictionaries import SparseAutoencoder

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent('''
    import sys
    import torch
    torch.set_num_threads(1)
    from lightning.pytorch import Trainer
    from torch.utils.data import DataLoader
    from editors import editable_graph
    from gradpatch.dictionaries import SparseAutoencoder
    from recipes.dictionary import DictionaryModule, EndToEndDictionaryModule
    from recipes.testing import tiny_backbone

    CHUNKS = torch.randint(3, 60, (16, 8), generator=torch.Generator().manual_seed(0))

    def fit(strategy, devices, batch_size, local, root, chunks=CHUNKS):
        pg = editable_graph(*tiny_backbone())
        sae = SparseAutoencoder(64, 128, "topk", k=8, node="model.layers_0.output",
                                generator=torch.Generator().manual_seed(0))
        module = (DictionaryModule(pg, sae, buffer_rows=16, lr=1e-2) if local
                  else EndToEndDictionaryModule(pg, sae, lr=1e-2))
        trainer = Trainer(max_steps=4, accelerator="cpu", devices=devices, strategy=strategy, logger=False,
                          enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                          default_root_dir=root)
        trainer.fit(module, DataLoader(chunks, batch_size=batch_size))
        return {"world_size": trainer.world_size, "rank": trainer.global_rank, "steps": trainer.global_step,
                "state": {name: t.detach().clone() for name, t in sae.state_dict().items()}}

    if __name__ == "__main__":
        out, local = sys.argv[1], sys.argv[2] == "local"
        result = fit("ddp", 2, 2, local, f"{out}/run")
        torch.save(result, f"{out}/ddp-rank{result['rank']}.pt")
        torch.distributed.destroy_process_group()  # as test_recipes_ddp.py's script does
''')


def _ranks(tmp_path: Path, mode: str) -> tuple[dict, dict]:
    script = tmp_path / "fit_ddp.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, str(script), str(tmp_path), mode], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return torch.load(tmp_path / "ddp-rank0.pt"), torch.load(tmp_path / "ddp-rank1.pt")


def test_end_to_end_on_two_ranks_equals_one_process_on_their_batches(tmp_path: Path) -> None:
    rank0, rank1 = _ranks(tmp_path, "e2e")
    namespace: dict = {"__name__": "single"}
    exec(compile(SCRIPT, "fit_ddp.py", "exec"), namespace)
    # Lightning shuffles training data under DDP (DistributedSampler, seed 0): rank r reads permutation[r::2].
    permutation = torch.randperm(16, generator=torch.Generator().manual_seed(0))
    single = namespace["fit"]("auto", 1, 4, False, str(tmp_path / "single"), namespace["CHUNKS"][permutation])
    assert rank0["world_size"] == 2 and rank0["steps"] == rank1["steps"] == single["steps"] == 4
    for name, tensor in single["state"].items():
        torch.testing.assert_close(rank0["state"][name], tensor, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(rank1["state"][name], tensor, rtol=1e-5, atol=1e-6)
    assert (tmp_path / "run" / "dictionary" / "dictionary.json").is_file()


def test_local_training_on_two_ranks_keeps_one_dictionary(tmp_path: Path) -> None:
    rank0, rank1 = _ranks(tmp_path, "local")
    start = SparseAutoencoder(64, 128, "topk", k=8, node="model.layers_0.output",
                              generator=torch.Generator().manual_seed(0)).state_dict()  # the script's initial SAE
    for name, tensor in rank0["state"].items():
        assert torch.equal(tensor, rank1["state"][name])
    assert not torch.allclose(rank0["state"]["W_enc"], start["W_enc"])
    assert (tmp_path / "run" / "dictionary" / "dictionary.json").is_file()
