"""DAS for a city's country on the embedded SmolLM2-135M-Instruct: IIA against layer and subspace size, beside
full-vector interchange at the same node; prints JSON.

Data: ``benchmarks/data/das_country_{train,eval}.jsonl`` (built by ``benchmarks/das_country_data.py``: cities the
model places correctly, train and eval cities disjoint). The node is the residual stream after a layer
(``model.layers_L.output``) at the last token of the city, in base and source.

Measured in one run, per layer: ``full_interchange_iia`` (the whole 576-wide vector swapped from the source: the
exact computation, nothing trained) and per subspace size ``k``: DAS IIA on the held-out pairs after ``--steps`` Adam
steps (:class:`~recipes.intervention_module.InterventionModule`'s forward, a plain loop), ``ratio_to_full``
(IIA / full-interchange IIA) and seconds per step. The target: some ``k <= 64`` reaches ``ratio_to_full >= 0.9``
at the best layer.

Run: ``.venv/bin/python benchmarks/das_country.py [--layers 2 6 10] [--dims 1 16 64] [--steps 60]
[--batch-size 16] [--lr 0.01] [--threads 2]``; ``--full-only`` measures the full-interchange IIA of each layer only;
``--save-model DIR`` writes the model for ``benchmarks/das_country_pyvene.py`` (pyvene 0.1.8, its own virtualenv).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):  # run as a script: make the repository root importable without an install
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gradpatch import FullInterchangePatch
from gradpatch.models import load_embedded_model
from recipes.counterfactual import read_counterfactuals
from recipes.intervention_module import InterventionModule

DATA = Path(__file__).resolve().parent / "data"


def train_das(module: InterventionModule, records: list, steps: int, batch_size: int, lr: float,
              seed: int) -> tuple[float, int]:
    """``steps`` Adam steps of IIT cross-entropy on batches of ``records`` (seeded order); returns (seconds, steps)."""
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.Adam(module.trainable_parameters(), lr=lr)
    order = torch.randperm(len(records), generator=generator).tolist()
    start = time.perf_counter()
    for step in range(steps):
        chosen = [records[order[(step * batch_size + i) % len(order)]] for i in range(batch_size)]
        encoded = module.encode(chosen)
        loss = torch.nn.functional.nll_loss(module.interchange_log_probs(encoded), encoded.labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return time.perf_counter() - start, steps


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 6, 10])
    parser.add_argument("--dims", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--das-layers", type=int, nargs="*", default=None,
                        help="layers to train DAS at (default: the layer with the best full-interchange IIA)")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--eval-pairs", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--full-only", action="store_true")
    parser.add_argument("--split", action="store_true",
                        help="a truncated source pass then the base pass, instead of one shared batch")
    parser.add_argument("--save-model", type=Path, default=None,
                        help="save the embedded model and tokenizer (save_pretrained) there for the pyvene script, "
                             "then stop")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    train = read_counterfactuals(DATA / "das_country_train.jsonl")
    test = read_counterfactuals(DATA / "das_country_eval.jsonl")[: args.eval_pairs]
    model, tokenizer = load_embedded_model()
    model.eval()
    if args.save_model is not None:
        model.save_pretrained(args.save_model)
        tokenizer.save_pretrained(args.save_model)
        return {"saved": str(args.save_model)}
    layers: dict[int, dict[str, Any]] = {}
    for layer in args.layers:
        module = InterventionModule.from_model(model, tokenizer, interventions=[
            {"node": f"model.layers_{layer}.output", "kind": "full"}])
        start = time.perf_counter()
        iia = float(module.iia(test, [FullInterchangePatch(576)]))
        layers[layer] = {"full_interchange_iia": iia, "eval_s": round(time.perf_counter() - start, 2), "das": {}}
        print(json.dumps({"layer": layer, **layers[layer]}), file=sys.stderr)
    best = max(layers, key=lambda layer: layers[layer]["full_interchange_iia"])
    for layer in ([] if args.full_only else args.das_layers or [best]):
        full = layers.setdefault(layer, {"full_interchange_iia": None, "das": {}})
        for dim in args.dims:
            torch.manual_seed(args.seed)
            module = InterventionModule.from_model(model, tokenizer, shared_batch=not args.split, interventions=[
                {"node": f"model.layers_{layer}.output", "kind": "rotated", "dim": dim}])
            seconds, steps = train_das(module, train, args.steps, args.batch_size, args.lr, args.seed)
            iia = float(module.iia(test))
            reference = full["full_interchange_iia"]
            full["das"][dim] = {"iia": iia, "ratio_to_full": None if not reference else iia / reference,
                                "seconds_per_step": round(seconds / steps, 3)}
            print(json.dumps({"layer": layer, "dim": dim, **full["das"][dim]}), file=sys.stderr)
    best_das = layers[best]["das"]
    result = {"benchmark": "das_country", "layers": layers, "best_layer": best,
              "target_met": any(dim <= 64 and (v["ratio_to_full"] or 0) >= 0.9 for dim, v in best_das.items()),
              "shared_batch": not args.split, "steps": args.steps, "batch_size": args.batch_size, "lr": args.lr, "eval_pairs": len(test),
              "train_pairs": len(train), "seed": args.seed, "threads": args.threads, "torch": torch.__version__,
              "machine": platform.processor() or platform.machine()}
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
