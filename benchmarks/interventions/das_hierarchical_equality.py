"""DAS on the hierarchical-equality MLP of pyvene's introductory DAS tutorial (DAS_Main_Introduction); prints JSON.

The task (Geiger et al. 2023, section 4.1): inputs are four random vectors W, X, Y, Z in [-1, 1]^4 (one 16-wide
input); the label is (W = X) = (Y = Z). A 3-layer ReLU MLP (width 16) is trained on it; then two rotated subspaces
of the first layer's output (8 dimensions each) are aligned with the causal model's intermediate variables WX = (W = X)
and YZ = (Y = Z) by interchange intervention training: each counterfactual swaps WX, YZ or both from sources, and the
label is what the causal model outputs after the same swap. Test IIA is measured on fresh vectors. pyvene's tutorial
reports test IIA 0.97 after 1,280,000 counterfactuals × 10 epochs (batch 6400, Adam lr 1e-3, 2000 steps) and an MLP
trained on 1,048,576 inputs × 3 epochs; the defaults here are 5-12× smaller (256,000 × 4 epochs, batch 1024, lr 3e-3;
MLP on 400,000 × 4 epochs, lr 3e-3) so that a run takes minutes on 2 CPU threads. The tutorial's sizes:
``--factual-examples 1048576 --mlp-epochs 3 --mlp-lr 1e-3 --examples 1280000 --batch-size 6400 --epochs 10 --lr 1e-3``.

Measured in one run: ``task_accuracy`` (MLP on fresh factual inputs), ``iia`` (DAS, test set), ``full_interchange_iia``
(interchanging the whole 16-wide layer output from the WX source: the exact baseline, which cannot separate WX from
YZ), ``train_s`` and ``seconds_per_step``.

Run: ``.venv/bin/python -m benchmarks.interventions.das_hierarchical_equality [--examples N] [--epochs E] [--threads
T]``.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from typing import Any

import torch
from torch import nn

from benchmarks.harness import emit
from gradpatch import FullInterchangePatch, PatchableGraph, RotatedSubspacePatch
from gradpatch.interventions.interchange import interchange_patch_map

EMBEDDING = 4
WIDTH = 4 * EMBEDDING
NODE = "layers_0.output"


class EqualityMLP(nn.Module):
    """``[batch, 1, 16] -> [batch, 1, 2]``: three Linear+ReLU layers of width 16 and a linear scorer."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU()) for _ in range(3))
        self.score = nn.Linear(WIDTH, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.score(x)


def sample(n: int, generator: torch.Generator, wx: torch.Tensor | None = None,
           yz: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``n`` inputs ``[n, 16]`` with their WX and YZ values ``[n]`` (bool): the four shapes of pyvene's sampler
    (ABCD, AABB, AACD, ABCC) uniformly, or with WX / YZ forced where given."""
    vectors = torch.rand(n, 4, EMBEDDING, generator=generator) * 2 - 1
    if wx is None:
        wx = torch.rand(n, generator=generator) < 0.5
    if yz is None:
        yz = torch.rand(n, generator=generator) < 0.5
    x = vectors.clone()
    x[wx, 1] = x[wx, 0]
    x[yz, 3] = x[yz, 2]
    return x.reshape(n, WIDTH), wx, yz


def train_mlp(args: argparse.Namespace, generator: torch.Generator) -> EqualityMLP:
    model = EqualityMLP()
    optimizer = torch.optim.Adam(model.parameters(), lr=args.mlp_lr)
    x, wx, yz = sample(args.factual_examples, generator)
    y = (wx == yz).long()
    for _ in range(args.mlp_epochs):
        order = torch.randperm(len(x), generator=generator)
        for start in range(0, len(x), 1024):
            index = order[start:start + 1024]
            loss = nn.functional.cross_entropy(model(x[index, None])[:, 0], y[index])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return model.eval()


def counterfactuals(n: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Base, WX source and YZ source ``[n, 16]`` each, and the label ``[n]``: intervention 0 swaps WX, 1 swaps YZ, 2
    both (uniformly); a variable that is not swapped has the base as its source (the interchange is then the
    identity on its subspace). The swapped value is balanced (True/False) as in pyvene's sampler."""
    base, base_wx, base_yz = sample(n, generator)
    which = torch.randint(0, 3, (n,), generator=generator)
    source_wx, wx, _ = sample(n, generator, wx=torch.rand(n, generator=generator) < 0.5)
    source_yz, _, yz = sample(n, generator, yz=torch.rand(n, generator=generator) < 0.5)
    swap_wx, swap_yz = which != 1, which != 0
    source_wx = torch.where(swap_wx[:, None], source_wx, base)
    source_yz = torch.where(swap_yz[:, None], source_yz, base)
    label = (torch.where(swap_wx, wx, base_wx) == torch.where(swap_yz, yz, base_yz)).long()
    return {"base": base, "source_wx": source_wx, "source_yz": source_yz, "label": label}


def interchange_logits(pg: PatchableGraph, patches: dict[str, Any], batch: dict[str, torch.Tensor],
                       source_of: dict[str, int] | None = None) -> torch.Tensor:
    """Logits ``[B, 2]`` of the base rows with the patches reading the WX source (0) and the YZ source (1)."""
    count = len(batch["label"])
    columns = [torch.zeros(count, 1, dtype=torch.long)] * 3
    rows = torch.cat([batch["base"], batch["source_wx"], batch["source_yz"]])[:, None]
    with pg.patch(interchange_patch_map(pg, patches, columns, source_of)):
        return pg(rows)[:count, 0]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--factual-examples", type=int, default=400_000)
    parser.add_argument("--mlp-epochs", type=int, default=4)
    parser.add_argument("--mlp-lr", type=float, default=3e-3)
    parser.add_argument("--examples", type=int, default=256_000, help="counterfactual training examples")
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--test-examples", type=int, default=10_000)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=42)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    generator = torch.Generator().manual_seed(args.seed)
    model = train_mlp(args, generator)
    test_x, test_wx, test_yz = sample(args.test_examples, generator)
    with torch.no_grad():
        task_accuracy = float((model(test_x[:, None])[:, 0].argmax(-1) == (test_wx == test_yz)).float().mean())
    print(json.dumps({"task_accuracy": task_accuracy}), file=sys.stderr)
    pg = PatchableGraph(model, torch.zeros(2, 1, WIDTH))
    pg.requires_grad_(False)
    wx_patch, yz_patch = RotatedSubspacePatch(WIDTH, WIDTH // 2), RotatedSubspacePatch(WIDTH, WIDTH // 2)
    optimizer = torch.optim.Adam([*wx_patch.parameters(), *yz_patch.parameters()], lr=args.lr)
    train = counterfactuals(args.examples, generator)
    steps, start = 0, time.perf_counter()
    for _ in range(args.epochs):
        order = torch.randperm(args.examples, generator=generator)
        for begin in range(0, args.examples, args.batch_size):
            index = order[begin:begin + args.batch_size]
            batch = {key: value[index] for key, value in train.items()}
            logits = _two_source_logits(pg, wx_patch, yz_patch, batch)
            loss = nn.functional.cross_entropy(logits, batch["label"])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            steps += 1
    train_s = time.perf_counter() - start
    test = counterfactuals(args.test_examples, generator)
    with torch.no_grad():
        iia = float((_two_source_logits(pg, wx_patch, yz_patch, test).argmax(-1) == test["label"]).float().mean())
        full = interchange_logits(pg, {NODE: FullInterchangePatch(WIDTH)}, test)
        full_iia = float((full.argmax(-1) == test["label"]).float().mean())
    result = {"benchmark": "das_hierarchical_equality", "task_accuracy": task_accuracy, "iia": iia,
              "full_interchange_iia": full_iia, "pyvene_tutorial_iia": 0.97, "target_iia": 0.95,
              "meets_target": iia >= 0.95, "steps": steps, "train_s": round(train_s, 2),
              "seconds_per_step": round(train_s / steps, 5), "threads": args.threads, "examples": args.examples,
              "batch_size": args.batch_size, "epochs": args.epochs, "lr": args.lr, "torch": torch.__version__,
              "machine": platform.processor() or platform.machine()}
    emit(result)
    return result


def _two_source_logits(pg: PatchableGraph, wx_patch: RotatedSubspacePatch, yz_patch: RotatedSubspacePatch,
                       batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Both patches at the first layer's output: WX's subspace from the WX source, then YZ's from the YZ source."""
    count = len(batch["label"])
    columns = [torch.zeros(count, 1, dtype=torch.long)] * 3
    rows = torch.cat([batch["base"], batch["source_wx"], batch["source_yz"]])[:, None]
    first = interchange_patch_map(pg, {NODE: wx_patch}, columns, {NODE: 0})
    second = interchange_patch_map(pg, {NODE: yz_patch}, columns, {NODE: 1})
    with pg.patch({NODE: first[NODE] + second[NODE]}):
        return pg(rows)[:count, 0]


if __name__ == "__main__":
    main()
