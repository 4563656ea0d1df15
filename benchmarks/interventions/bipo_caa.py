"""BiPO against CAA: steering vectors at one node, compared at equal norm on held-out prompts.

Preference set (benchmarks/interventions/build_reft_data.py): opinion prompts about 20 training topics and 10 held-out
topics, each with a positive (chosen) and a negative (rejected) one-word continuation. On the embedded
SmolLM2-135M-Instruct at ``model.layers_{L}.output`` (every token):

- BiPO: :class:`recipes.ReFTModule` with a ``steer`` vector and :class:`recipes.BiPOObjective` (β, direction drawn
  from {−1, +1} per step);
- CAA: :func:`recipes.caa_vector` on the same training pairs (mean activation over the continuation's tokens,
  chosen minus rejected).

Each vector is rescaled to the same norms (BiPO's own and the listed ones) and scored on the held-out pairs:
``logratio_margin`` = mean [log π_v(chosen) − log π(chosen)] − [log π_v(rejected) − log π(rejected)] (teacher forcing,
exact), ``preference_accuracy`` (fraction with margin > 0), and ``sentiment``: the mean of (# positive − # negative
words of the two word lists) over greedy 12-token continuations of the held-out prompts (the unsteered model's
score beside it). Prints JSON.

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python -m benchmarks.interventions.bipo_caa --steps 60
"""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path

import torch
from lightning.pytorch import Trainer, seed_everything

from benchmarks.harness import emit
from benchmarks.interventions.build_reft_data import NEGATIVE, POSITIVE
from gradpatch.files.loaders import load_embedded_model
from recipes import BiPOObjective, PreferenceDataModule, ReFTModule, caa_vector

DATA = Path(__file__).resolve().parents[1] / "data"


def _sentiment(texts: list[str]) -> float:
    """Mean over texts of (# words in POSITIVE − # words in NEGATIVE)."""
    score = 0
    for text in texts:
        words = re.findall(r"[a-z]+", text.lower())
        score += sum(w in POSITIVE for w in words) - sum(w in NEGATIVE for w in words)
    return score / max(1, len(texts))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--layer", type=int, default=10)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--beta", type=float, default=0.1)
    parser.add_argument("--norms", type=float, nargs="*", default=[4.0, 8.0, 16.0])
    args = parser.parse_args()
    model, tokenizer = load_embedded_model()
    data = PreferenceDataModule(str(DATA / "bipo_sentiment_train.jsonl"), str(DATA / "bipo_sentiment_eval.jsonl"),
                                batch_size=8)
    data.setup()
    node = f"model.layers_{args.layer}.output"
    seed_everything(0, verbose=False)
    module = ReFTModule.from_model(model, tokenizer, lr=args.lr, objective=BiPOObjective(beta=args.beta),
                                   interventions=[{"node": node, "kind": "steer"}])
    start = time.process_time()
    trainer = Trainer(max_steps=args.steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0)
    trainer.fit(module, datamodule=data)
    seconds = time.process_time() - start
    value = module.intervention.values[0]
    bipo = value.detach().clone()
    caa = caa_vector(module, node, data.train_records)
    prompts = sorted({r.prompt for r in data.eval_records})
    with torch.no_grad():
        value.zero_()
    plain = module.generate(prompts, max_new_tokens=12, batch_size=16)
    report = {"node": node, "steps": args.steps, "cpu_seconds_training": seconds, "nan": bool(bipo.isnan().any()),
              "bipo_norm": float(bipo.norm()), "caa_norm": float(caa.norm()),
              "cosine": float(torch.nn.functional.cosine_similarity(bipo, caa, dim=0)),
              "unsteered_sentiment": _sentiment(plain), "unsteered_examples": plain[:2], "rows": []}
    for norm in [float(bipo.norm()), *args.norms]:
        for name, vector in (("bipo", bipo), ("caa", caa)):
            with torch.no_grad():
                value.copy_(vector / vector.norm() * norm)
            texts = module.generate(prompts, max_new_tokens=12, batch_size=16)
            scores = module.evaluate(data.eval_records)
            report["rows"].append({"vector": name, "norm": round(norm, 3), **scores,
                                   "sentiment": _sentiment(texts), "examples": texts[:2]})
            print(json.dumps(report["rows"][-1]), flush=True)
    emit(report, indent=1)


if __name__ == "__main__":
    main()
