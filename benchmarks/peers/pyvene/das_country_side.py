"""The DAS country task with pyvene 0.1.8 (a peer, in its own virtualenv), on the data, hyperparameters and seed of
``benchmarks/interventions/das_country.py``; prints JSON (IIA and seconds per step).

pyvene is never a dependency of gradpatch: this script runs with pyvene's interpreter (``make peers PEERS=pyvene``
builds it), ``.peers/pyvene/bin/python -m benchmarks.peers.pyvene.das_country_side --model DIR`` from the
repository's root, where ``DIR`` is the embedded SmolLM2 saved with ``save_pretrained``
(``python -m benchmarks.interventions.das_country --save-model DIR`` writes it). Same records, same order
(``torch.randperm`` with the seed), batch size, learning rate, steps and subspace size; the intervention is
``LowRankRotatedSpaceIntervention`` at ``block_output`` of the layer (the residual stream after it, gradpatch's
``model.layers_L.output``) at the last token of the city in base and source, with left-padded batches and
``position_ids`` from the attention mask as gradpatch uses. ``--init-rotation FILE`` starts from gradpatch's starting
rotation (``das_country.py --save-rotation``: R, and the state of torch's orthogonal parametrization, whose random
orthogonal completion of R also steers the training), so that the two runs start alike (``losses``: the first step's
loss is equal; see ``das_country.py`` for why later ones drift apart).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.harness import ROOT, emit, version_of

DATA = ROOT / "benchmarks" / "data"


def read(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def last_token_of(tokenizer: Any, prompt: str, subject: str) -> int:
    start = prompt.rfind(subject)
    end = start + len(subject)
    offsets = tokenizer(prompt, return_offsets_mapping=True, add_special_tokens=False)["offset_mapping"]
    return [i for i, (low, high) in enumerate(offsets) if low < end and high > start][-1]


def side(tokenizer: Any, prompts: list[str], subjects: list[str], pad_id: int) -> tuple[dict[str, torch.Tensor],
                                                                                         list[int]]:
    """Left-padded inputs and the column of each row's subject token."""
    ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    width = max(len(row) for row in ids)
    input_ids = torch.full((len(ids), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(ids), width), dtype=torch.long)
    for i, row in enumerate(ids):
        input_ids[i, width - len(row):] = torch.tensor(row)
        mask[i, width - len(row):] = 1
    columns = [width - len(row) + last_token_of(tokenizer, p, s) for row, p, s in zip(ids, prompts, subjects)]
    return {"input_ids": input_ids, "attention_mask": mask,
            "position_ids": (mask.cumsum(-1) - 1).clamp(min=0)}, columns


def logits_of(intervenable: Any, tokenizer: Any, records: list[dict[str, Any]], pad_id: int) -> torch.Tensor:
    base, base_cols = side(tokenizer, [r["base"] for r in records], [r["base_subject"] for r in records], pad_id)
    source, source_cols = side(tokenizer, [r["source"] for r in records], [r["source_subject"] for r in records],
                               pad_id)
    locations = {"sources->base": ([[[c] for c in source_cols]], [[[c] for c in base_cols]])}
    device = next(intervenable.model.parameters()).device
    base = {name: tensor.to(device) for name, tensor in base.items()}
    source = {name: tensor.to(device) for name, tensor in source.items()}
    _, counterfactual = intervenable(base, [source], locations)
    return torch.log_softmax(counterfactual.logits[:, -1].float(), dim=-1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--layer", type=int, default=6)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--eval-pairs", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    parser.add_argument("--init-rotation", type=Path, default=None, metavar="FILE",
                        help="start from this rotation state (das_country.py --save-rotation) instead of pyvene's own")
    args = parser.parse_args()
    import pyvene
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).to(args.device).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    train, test = read(DATA / "das_country_train.jsonl"), read(DATA / "das_country_eval.jsonl")[: args.eval_pairs]
    torch.manual_seed(args.seed)
    config = pyvene.IntervenableConfig(
        representations=[pyvene.RepresentationConfig(args.layer, "block_output", "pos", 1,
                                                     low_rank_dimension=args.dim)],
        intervention_types=pyvene.LowRankRotatedSpaceIntervention)
    intervenable = pyvene.IntervenableModel(config, model)
    intervenable.set_device(args.device)
    intervenable.disable_model_gradients()
    parameters = [p for intervention in intervenable.interventions.values() for p in
                  (intervention[0] if isinstance(intervention, tuple) else intervention).parameters()]
    if args.init_rotation is not None:  # gradpatch's starting rotation: R [k, d] here is pyvene's weight [d, k]
        from safetensors.torch import load_file

        state = load_file(str(args.init_rotation))
        layer = next(iter(intervenable.interventions.values()))
        layer = (layer[0] if isinstance(layer, tuple) else layer).rotate_layer
        if tuple(layer.weight.shape) != tuple(state["R"].T.shape):
            raise SystemExit(f"--init-rotation: R is {tuple(state['R'].shape)}, pyvene's weight "
                             f"{tuple(layer.weight.shape)}; save it with the same --layer and --dim")
        parametrization = layer.parametrizations.weight  # torch's orthogonal map treats [k, d] as its transpose
        with torch.no_grad():
            parametrization.original.copy_(state["original"].T)
            parametrization[0].base.copy_(state["base"])
        if not torch.allclose(layer.weight.detach().cpu(), state["R"].T, atol=1e-6):
            raise SystemExit("--init-rotation: the parametrization did not reproduce R")
    optimizer = torch.optim.Adam(parameters, lr=args.lr)
    generator = torch.Generator().manual_seed(args.seed)
    order = torch.randperm(len(train), generator=generator).tolist()
    labels_of = {}
    losses = []
    start = time.perf_counter()
    for step in range(args.steps):
        chosen = [train[order[(step * args.batch_size + i) % len(order)]] for i in range(args.batch_size)]
        labels = torch.tensor([labels_of.setdefault(r["label"], tokenizer(r["label"], add_special_tokens=False)
                                                    ["input_ids"][0]) for r in chosen])
        log_probs = logits_of(intervenable, tokenizer, chosen, pad_id)
        loss = torch.nn.functional.nll_loss(log_probs, labels.to(log_probs.device))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    train_s = time.perf_counter() - start
    hits = 0
    with torch.no_grad():
        for begin in range(0, len(test), 64):
            chunk = test[begin:begin + 64]
            labels = torch.tensor([tokenizer(r["label"], add_special_tokens=False)["input_ids"][0] for r in chunk])
            hits += int((logits_of(intervenable, tokenizer, chunk, pad_id).argmax(-1).cpu() == labels).sum())
    emit({"benchmark": "das_country_pyvene", "pyvene": version_of("pyvene"), "layer": args.layer, "dim": args.dim,
          "iia": hits / len(test), "seconds_per_step": round(train_s / args.steps, 3), "steps": args.steps,
          "batch_size": args.batch_size, "lr": args.lr, "eval_pairs": len(test), "seed": args.seed,
          "threads": args.threads, "device": args.device, "init_rotation": str(args.init_rotation),
          "losses": [round(float(loss), 5) for loss in losses]}, device=args.device)


if __name__ == "__main__":
    main()
