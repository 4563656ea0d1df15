"""MEMIT and AlphaEdit with the facts split over 2 CPU processes (Lightning's DDP launcher, gloo; tiny Llama): the
edit equals one process's, and a process given other requests or sampling other context prefixes stops both with the
reason (no process left waiting); either way no process group is left for gloo to abort the process at exit.

Each run starts a script in a subprocess (Lightning's launcher re-runs it for rank 1). ``timeout=`` on the subprocess
only turns a hang into a failed test instead of a stuck suite.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from editors import BatchEdit, EditError
from editors.distributed import FactShards

ROOT = Path(__file__).resolve().parents[2]
HANG_GUARD_S = 600

SCRIPT = textwrap.dedent('''
    import os, sys
    import torch
    torch.set_num_threads(1)
    from editors import EditError, EditRequest, resolve_layer
    from editors.alphaedit import AlphaEdit, AlphaEditConfig
    from editors.config import MEMITConfig
    from editors.memit import MEMIT
    from gradpatch import PatchableGraph
    from gradpatch.testing import byte_level_tokenizer, tiny_llama
    from recipes import run_distributed_edit

    NODES = ["model.layers_0.mlp.down_proj", "model.layers_1.mlp.down_proj"]
    REQUESTS = [EditRequest("The river flows into the sea near {}", "the old town", "Rome"),
                EditRequest("I think the answer is {}", "the bridge", "Paris"),
                EditRequest("Because it rains, we stay home in {}", "Madrid", "Rome"),
                EditRequest("She bought a small house in {}", "the valley", "Paris"),
                EditRequest("My favourite food comes from {}", "the island", "Madrid")]

    def build(method):
        def make(device, shards):
            tok = byte_level_tokenizer()
            model = tiny_llama(len(tok), layers=3).to(device)
            ids = torch.randint(0, len(tok), (2, 6), generator=torch.Generator().manual_seed(0)).to(device)
            pg = PatchableGraph(model, ids, use_cache=False).eval()
            generator = torch.Generator().manual_seed(1)
            stats = []
            for node in NODES:
                d_in = resolve_layer(pg, node).d_in
                a = torch.randn(d_in, d_in // 2, generator=generator, dtype=torch.float64)  # a null space for
                stats.append(a @ a.T / d_in + 1e-3 * torch.eye(d_in, dtype=torch.float64))  # AlphaEdit to keep
            options = dict(progress=False, use_cache=False, clamp_factor=500.0,
                           context_length_params=((5, 4), (10, 4)), steps=8)
            cls, config = (AlphaEdit, AlphaEditConfig) if method == "alphaedit" else (MEMIT, MEMITConfig)
            if sys.argv[4] == "prefixes" and os.environ.get("LOCAL_RANK", "0") == "1":
                options["template_seed"] = 1  # the context prefixes are sampled from the model with this seed
            return cls(pg, tok, NODES, config(**options), statistics=stats, shards=shards)
        return make

    if __name__ == "__main__":
        out, devices, method, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
        rank = os.environ.get("LOCAL_RANK", "0")
        requests = REQUESTS[::-1] if (mode == "disagree" and rank == "1") else REQUESTS
        try:
            run_distributed_edit(build(method), requests, devices=devices, out=out + "/edit")
        except EditError as error:
            with open(f"{out}/error{rank}.txt", "w") as f:
                f.write(str(error))
        with open(f"{out}/group{rank}.txt", "w") as f:  # the function destroys the process group it started
            f.write(str(torch.distributed.is_initialized()))
''')


def _run(tmp_path: Path, name: str, devices: int, method: str = "memit", mode: str = "same") -> Path:
    out = tmp_path / name
    out.mkdir()
    script = tmp_path / "edit_script.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, str(script), str(out), str(devices), method, mode], env=env,
                          capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert done.returncode == 0, done.stderr[-3000:]
    assert [(out / f"group{rank}.txt").read_text() for rank in range(devices)] == ["False"] * devices
    return out


@pytest.mark.parametrize("method", ["memit", "alphaedit"])
def test_two_processes_compute_the_one_process_edit(tmp_path: Path, method: str) -> None:
    one = BatchEdit.load(_run(tmp_path, "one", 1, method) / "edit")
    two = BatchEdit.load(_run(tmp_path, "two", 2, method) / "edit")
    assert [r.to_dict() for r in two.requests] == [r.to_dict() for r in one.requests]
    for a, b in zip(one.edits, two.edits, strict=True):
        assert a.node == b.node
        reference = (a.v.double() @ a.u.double().T)  # ΔW [d_out, d_in]
        difference = (b.v.double() @ b.u.double().T) - reference
        assert float(difference.abs().max() / reference.abs().max()) <= 1e-5, a.node
    assert (one.info["processes"], two.info["processes"]) == (1, 2)
    assert [f["steps"] for f in two.info["facts"]] == [f["steps"] for f in one.info["facts"]]


@pytest.mark.parametrize("mode,reason", [("disagree", "other model or requests"),
                                         ("prefixes", "other context prefixes")])
def test_a_process_given_other_inputs_stops_every_process_with_the_reason(tmp_path: Path, mode: str,
                                                                          reason: str) -> None:
    out = _run(tmp_path, mode, 2, mode=mode)
    for rank in (0, 1):
        assert reason in (out / f"error{rank}.txt").read_text()
    assert not (out / "edit").exists()


class _Rank(FactShards):
    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size


def test_spans_cover_the_facts_in_order_and_need_one_fact_per_process() -> None:
    spans = [_Rank(rank, 3).span(8) for rank in range(3)]
    assert [list(s) for s in spans] == [[0, 1, 2], [3, 4, 5], [6, 7]]
    with pytest.raises(EditError, match="2 facts for 3 processes"):
        _Rank(0, 3).span(2)
    assert FactShards().collect(lambda: [torch.ones(2)], 1)[0].shape == (2,)
