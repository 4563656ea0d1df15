"""The gradpatch side of benchmarks/interventions/reft_pyreft.py: LoReFT training steps in a process of their own, so
that their seconds and peak memory are measured as pyreft's are (benchmarks/peers/pyreft/reft_side.py, another process).

Reads IN.safetensors (written by benchmarks/interventions/reft_pyreft.py: token ids, positions, R, W, b, the seed of R's
assignment), loads the embedded model in R's dtype, and writes OUT.json: the losses, the median seconds per step
(forward + backward + Adam; wall and CPU), the resident memory before the steps and its peak during them (MiB,
benchmarks/harness.py).

    PYTHONPATH=$PWD python -m benchmarks.interventions.reft_pyreft_ours IN.safetensors OUT.json LAYER STEPS POSITIONS
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from benchmarks.harness import median, timed_steps
from gradpatch import LoReFTPatch, PatchableGraph
from gradpatch.files.loaders import load_embedded_model
from gradpatch.interventions.reft import reft_patch_map


def assign_rotation(patch: LoReFTPatch, rotation: torch.Tensor, seed: int) -> None:
    """Set R ``[r, d]`` through the orthogonal parametrization's right inverse, its random draw seeded.

    The right inverse completes R to a square orthogonal matrix with random columns (a QR decomposition), which the
    parametrization keeps as its base: R read back differs from ``rotation`` by rounding (~1e-7 in float32; the
    random columns do not change it), and the random columns decide how a gradient step moves R. pyreft's side
    assigns the same matrix to its tall Rᵀ ``[d, r]`` (the parametrization transposes a wide matrix to a tall one
    first) with the same seed, so both sides hold the same R and the same base.
    """
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        patch.rotation.weight = rotation


def loreft_from(data: dict[str, torch.Tensor], positions: str) -> LoReFTPatch:
    """The :class:`LoReFTPatch` of IN.safetensors' R, W, b (in their dtype), R assigned with its seed."""
    rank, width = data["R"].shape
    patch = LoReFTPatch(width, rank, positions=positions).to(data["R"].dtype)
    with torch.no_grad():
        patch.projection.weight.copy_(data["W"])
        patch.projection.bias.copy_(data["b"])
    assign_rotation(patch, data["R"], int(data["seed"]))
    return patch


def train_steps(pg: PatchableGraph, node: str, patch: LoReFTPatch, ids: torch.Tensor, prompt_length: int,
                steps: int) -> dict[str, float | list[float]]:
    """``steps`` Adam steps (lr 1e-3) of the response tokens' NLL ``ids[:, prompt_length:]`` with ``patch`` at the
    prompt's positions of ``node``: losses, median wall and CPU seconds per step, resident MiB before, peak during."""
    optimizer = torch.optim.Adam(patch.parameters(), lr=1e-3)

    def loss_of(_: int) -> torch.Tensor:
        with pg.patch(reft_patch_map({node: patch}, [prompt_length] * len(ids))):
            out = pg(ids, use_cache=False).logits[:, prompt_length - 1:-1]
        return torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), ids[:, prompt_length:].reshape(-1))

    run = timed_steps(optimizer, range(steps), loss_of)
    return {"losses": run.losses, "seconds_per_step": median(run.seconds),
            "cpu_seconds_per_step": median(run.cpu_seconds), "resident_mib_before_steps": run.resident_mib_before,
            "peak_mib_during_steps": run.peak_mib}


def main() -> None:
    source, target, layer, steps, positions = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    data = load_file(source)
    model, _ = load_embedded_model(dtype=data["R"].dtype)
    model.eval().requires_grad_(False)  # frozen, as ReFTModule's graph and pyreft's get_reft_model leave it
    ids = data["input_ids"]
    patch = loreft_from(data, positions)
    pg = PatchableGraph(model, ids, use_cache=False)
    result = train_steps(pg, f"model.layers_{layer}.output", patch, ids, int(data["prompt_length"]), steps)
    Path(target).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
