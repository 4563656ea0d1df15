"""The statistics job under Lightning's ``ddp`` strategy: 2 CPU processes, gloo backend, tiny model.

Each run starts a script in a subprocess (Lightning's launcher re-runs it for rank 1). Covered: 2 ranks killed at
about half way (SIGKILL, after a checkpoint) and started again equal 1 uninterrupted rank; a non-finite sum on one rank
stops both; ranks that load different models stop before any forward pass. ``timeout=`` on the subprocess only turns
a hang (the failure these tests guard against) into a failed test instead of a stuck suite.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

from editors import compute_second_moments, editable_graph, resolve_layer

ROOT = Path(__file__).resolve().parents[2]
HANG_GUARD_S = 600

SCRIPT = textwrap.dedent('''
    import json, os, random, signal, sys
    import torch
    torch.set_num_threads(1)
    from lightning.pytorch import Callback
    from editors import Corpus, editable_graph
    from recipes import SecondMomentJob, run_statistics_job
    from recipes.testing import WORDS, tiny_backbone

    NODES = ["model.layers_0.mlp.down_proj", "model.layers_1.self_attn.o_proj"]

    def word_corpus():
        rng = random.Random(0)
        return Corpus(name="tiny-words", texts=[" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 30)))
                                                for _ in range(40)])

    class Kill(Callback):  # SIGKILL this rank once 12 of its 20 documents are done (checkpoints every 4)
        def on_predict_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
            if pl_module.done >= 12:
                os.kill(os.getpid(), signal.SIGKILL)

    class NaNOnRank1(Callback):  # rank 1's model gives NaN from its third batch on
        def on_predict_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
            if trainer.global_rank == 1 and batch_idx == 2:
                pl_module.pg.wrapped_model.model.embed_tokens.weight.data[:, 0] = float("nan")
                record["bad_document"] = pl_module.shard[pl_module.done]

    if __name__ == "__main__":
        out, mode = sys.argv[1], sys.argv[2]
        rank = int(os.environ.get("LOCAL_RANK", "0"))
        seed = 1 if (mode == "disagree" and rank == 1) else 0
        model, tokenizer = tiny_backbone(seed=seed)
        record = {"rank": rank}
        job = SecondMomentJob(editable_graph(model, tokenizer), tokenizer, NODES, word_corpus(), n_samples=40,
                              max_length=16, batch_size=4, checkpoint_every=4, cache_dir=f"{out}/stats")
        callbacks = {"kill": [Kill()], "nan": [NaNOnRank1()]}.get(mode, [])
        try:
            moments = run_statistics_job(job, accelerator="cpu", devices=2, strategy="ddp", callbacks=callbacks,
                                         enable_progress_bar=False)
            torch.save([m.matrix for m in moments], f"{out}/{mode}-rank{rank}.pt")
            record.update(n_tokens=moments[0].n_tokens, n_samples=moments[0].n_samples,
                          resumed_from=None if job.partial is None else job.partial.documents_done,
                          world_size=job.trainer.world_size, shard=job.shard,
                          backend=job.trainer.strategy.process_group_backend)
        except Exception as error:
            record.update(error=type(error).__name__, message=str(error))
        record["group_left"] = torch.distributed.is_initialized()  # the job destroys the group it started
        with open(f"{out}/{mode}-rank{rank}.json", "w") as handle:
            json.dump(record, handle)
''')


def launch(tmp_path: Path, mode: str) -> subprocess.CompletedProcess:
    script = tmp_path / "stats_ddp.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, str(script), str(tmp_path), mode], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=HANG_GUARD_S)


def records(tmp_path: Path, mode: str) -> list[dict]:
    return [json.loads((tmp_path / f"{mode}-rank{rank}.json").read_text()) for rank in (0, 1)
            if (tmp_path / f"{mode}-rank{rank}.json").is_file()]


def cache_files(tmp_path: Path) -> list[Path]:
    return [path for path in (tmp_path / "stats").glob("*/*.safetensors") if path.parent.name != "partial"]


def single_process_reference() -> tuple[list[torch.Tensor], int]:
    namespace: dict = {"__name__": "reference"}
    exec(compile(SCRIPT, "stats_ddp.py", "exec"), namespace)
    model, tokenizer = namespace["tiny_backbone"](seed=0)
    pg = editable_graph(model, tokenizer)
    matrices, n_tokens, _ = compute_second_moments(pg, tokenizer, [resolve_layer(pg, n) for n in namespace["NODES"]],
                                                   namespace["word_corpus"](), n_samples=40, max_length=16,
                                                   batch_size=4, progress=False)
    return matrices, n_tokens


def test_two_ranks_killed_half_way_and_resumed_equal_one_rank(tmp_path):
    killed = launch(tmp_path, "kill")
    assert killed.returncode != 0 and not records(tmp_path, "kill")  # both ranks died before writing anything
    checkpoints = sorted((tmp_path / "stats" / "partial").glob("rank*.safetensors"))
    assert [p.name for p in checkpoints] == ["rank00000.safetensors", "rank00001.safetensors"]
    assert not cache_files(tmp_path)  # no cache file yet

    resumed = launch(tmp_path, "resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    rank0, rank1 = records(tmp_path, "resume")
    assert rank0["world_size"] == 2 and rank0["backend"] == "gloo"
    assert not rank0["group_left"] and not rank1["group_left"]
    assert rank0["resumed_from"] == rank1["resumed_from"] == 12  # each rank went on from its own checkpoint
    assert sorted(rank0["shard"]) == list(range(0, 40, 2)) and sorted(rank1["shard"]) == list(range(1, 40, 2))
    reference, n_tokens = single_process_reference()
    assert rank0["n_tokens"] == rank1["n_tokens"] == n_tokens and rank0["n_samples"] == 40
    for rank in (0, 1):
        for matrix, expected in zip(torch.load(tmp_path / f"resume-rank{rank}.pt"), reference):
            assert float((matrix - expected).abs().max() / expected.abs().max()) <= 1e-6
    assert len(cache_files(tmp_path)) == 2  # one cache file per node, by rank 0
    assert not list((tmp_path / "stats" / "partial").glob("*.safetensors"))


def test_non_finite_sums_on_one_rank_stop_every_rank(tmp_path):
    result = launch(tmp_path, "nan")
    assert result.returncode == 0, result.stderr[-3000:]  # the script records the errors itself
    found = records(tmp_path, "nan")
    assert len(found) == 2 and found[0]["rank"] == 0  # rank 0 finished its own shard, then learned of rank 1's NaN
    bad = found[1]["bad_document"]  # the first document of rank 1's third batch
    assert bad % 2 == 1
    for record in found:
        assert record["error"] == "NonFiniteError" and not record["group_left"]
        assert f"(rank, corpus document): [(1, {bad})]" in record["message"]
    assert not cache_files(tmp_path)


def test_ranks_with_different_models_stop_before_any_work(tmp_path):
    result = launch(tmp_path, "disagree")
    assert result.returncode == 0, result.stderr[-3000:]
    found = records(tmp_path, "disagree")
    assert len(found) == 2
    for record in found:
        assert record["error"] == "StatisticsJobError" and not record["group_left"]
        assert "ranks [1] disagree with rank 0 on fingerprints" in record["message"]
    assert not (tmp_path / "stats" / "partial").exists()
