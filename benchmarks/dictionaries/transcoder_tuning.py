"""Tuning skip transcoders at a few of SmolLM2's MLPs at small token budgets, on development text.

The recipe (``recipes/configs/transcoders_smollm2.yaml``) reports its figures on held-out text: the first documents
of the corpus (``data.eval_tokens`` of them, :class:`recipes.dictionary.DictionaryDataModule`); it trains on the
documents after them, in order. Settings are chosen here on *development* text instead: the corpus's last documents
(``--dev-tokens`` of them; the offline Wikipedia summaries hold ~1.1M tokens, so no budget run here reaches them).

1. ``cache``: one forward pass of the frozen model per batch of training chunks (stopped after the deepest layer)
   writes the MLP inputs and outputs of ``--layers`` (positions 0 and 1 of every chunk left out, as the recipe
   does) to ``WORK/rows.safetensors``, in corpus order; the development documents' ids to ``WORK/dev.safetensors``.
2. ``trial``: one skip transcoder per layer trained on the first ``--tokens`` cached rows, as
   :class:`recipes.dictionary.DictionaryModule` trains it (TopK decoded from its k active latents, FVU + α AuxK over
   latents dead for ``--dead-after`` tokens, unit-norm decoder rows with the parallel gradient removed, Adam at
   :func:`recipes.dictionary.lr_factor`'s schedule), the rows drawn in a random order (the recipe's shuffle buffer
   mixes ``buffer_rows``), ``--epochs`` times, each pass in a new order; its initialisation: b_dec the first step's
   target mean, or with ``--skip-init least_squares`` W_skip and b_dec by
   :func:`recipes.dictionary.least_squares_skip` on the first ``--init-rows`` rows. Then scored on the development
   documents (one per forward pass, from position 2): per layer FVU, L0, dead fraction (latents unfired on them)
   and CE loss recovered with that layer spliced alone, as :func:`gradpatch.dictionaries.evaluate_layers` defines
   them (the model's CE and the zero-ablated CEs computed once per ``WORK``); ``--fvu-only``: FVU, L0 and dead
   fraction only, from the documents' activations kept in ``WORK`` (no forward pass: for quick screening);
   ``--full-eval``: :func:`~gradpatch.dictionaries.evaluate_layers` itself, which adds the CE loss recovered with the
   listed layers spliced at once. Prints one JSON line (and appends it to ``WORK/trials.jsonl``).

Run: ``OMP_NUM_THREADS=2 .venv/bin/python -m benchmarks.dictionaries.transcoder_tuning cache --work W --tokens 32768``
then ``... trial --work W --tokens 16384 --batch-rows 252 --lr 0.002``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from benchmarks.harness import emit

EXCLUDED = 2


def graph_and_nodes(layers: list[int]) -> tuple[Any, Any, list[str], list[str]]:
    """``(pg, tokenizer, MLP input nodes, MLP output nodes)`` of the embedded SmolLM2 at ``layers``."""
    from recipes.dictionary.fit import layer_nodes, load_graph

    pg, tokenizer = load_graph(None, "float32")
    return pg, tokenizer, layer_nodes(pg, "mlp_input", layers), layer_nodes(pg, "mlp", layers)


def cache(args: argparse.Namespace) -> dict[str, Any]:
    """Step 1 (module docstring)."""
    from gradpatch.capture import node_activations
    from recipes.dictionary.corpus import packed_chunks, read_documents, tokenize_documents

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    pg, tokenizer, inputs, outputs = graph_and_nodes(args.layers)
    documents = read_documents(None)
    _, read = tokenize_documents(tokenizer, documents, args.eval_tokens, args.chunk)  # the recipe's held-out text
    dev, _ = tokenize_documents(tokenizer, documents[-args.dev_documents:], args.dev_tokens, args.chunk)
    chunks = packed_chunks(tokenizer, documents[read:], args.tokens // args.chunk, args.chunk, args.chunk)
    start = time.perf_counter()
    parts: list[torch.Tensor] = []
    for batch in chunks.split(8):
        acts = node_activations(pg, inputs + outputs, batch)
        parts.append(torch.cat([a[:, EXCLUDED:].reshape(-1, a.shape[-1]).float() for a in acts], -1))
    rows = torch.cat(parts)
    save_file({"rows": rows.contiguous(), "layers": torch.tensor(args.layers)}, str(work / "rows.safetensors"))
    save_file({f"dev_{i}": torch.tensor(ids) for i, ids in enumerate(dev)}, str(work / "dev.safetensors"))
    return {"rows": rows.shape[0], "tokens": int(chunks.numel()), "dev_tokens": sum(map(len, dev)),
            "seconds": time.perf_counter() - start}


def train_layer(x: torch.Tensor, y: torch.Tensor, args: argparse.Namespace, layer: int, nodes: tuple[str, str],
                order: torch.Tensor) -> Any:
    """One skip transcoder trained on rows ``x``, ``y`` ``[n, d]`` in ``order`` (module docstring, step 2)."""
    from gradpatch.dictionaries import (SkipTranscoder, auxk_loss, normalized_mse, remove_parallel_gradient,
                                        sparse_decode, unit_norm_rows)
    from recipes.dictionary.settings import least_squares_skip, lr_factor

    d = x.shape[1]
    tc = SkipTranscoder(d, args.expansion * d, d, "topk", args.k, input_node=nodes[0], output_node=nodes[1],
                        exclude_first_positions=EXCLUDED,
                        generator=torch.Generator().manual_seed(args.seed + layer))
    with torch.no_grad():
        if args.skip_init == "least_squares":
            init = order[:args.init_rows]
            weight, bias = least_squares_skip(x[init], y[init], args.ridge)
            tc.W_skip.copy_(weight)
            tc.b_dec.copy_(bias)
        else:
            tc.b_dec.copy_(y[order[:args.batch_rows]].mean(0))
        if args.enc_scale != 1.0:
            tc.W_enc.mul_(args.enc_scale)
    optimizer = torch.optim.Adam(tc.parameters(), lr=args.lr)
    steps = len(order) // args.batch_rows
    warmup = round(args.warmup * steps) if args.warmup < 1 else int(args.warmup)
    since = torch.zeros(tc.d_sae, dtype=torch.long)
    for step in range(steps):
        rows = order[step * args.batch_rows:(step + 1) * args.batch_rows]
        xb, yb = x[rows], y[rows]
        for group in optimizer.param_groups:
            group["lr"] = args.lr * lr_factor(step, steps, warmup, args.decay)
        h = tc.pre_activations(xb)
        values, indices = h.topk(args.k, dim=-1, sorted=False)
        prediction = sparse_decode(indices, values.relu(), tc.W_dec) + tc.b_dec + tc.skip(xb)
        loss = normalized_mse(prediction, yb)
        with torch.no_grad():
            fired = torch.zeros(tc.d_sae, dtype=torch.bool)
            fired[indices[values > 0]] = True
            since += xb.shape[0]
            since[fired] = 0
        dead = since > args.dead_after
        if args.auxk > 0:
            loss = loss + args.auxk * auxk_loss(h, yb - prediction, tc.W_dec, dead, d // 2)
        optimizer.zero_grad()
        loss.backward()
        tc.W_dec.grad = remove_parallel_gradient(tc.W_dec.detach(), tc.W_dec.grad)
        optimizer.step()
        with torch.no_grad():
            tc.W_dec.copy_(unit_norm_rows(tc.W_dec))
    return tc, steps


def trial(args: argparse.Namespace) -> dict[str, Any]:
    """Step 2 (module docstring)."""
    from gradpatch.dictionaries import evaluate_layers, per_layer_dictionaries

    work = Path(args.work)
    cached = load_file(str(work / "rows.safetensors"))
    layers = cached["layers"].tolist()
    rows = cached["rows"][:max(args.tokens // args.chunk, 1) * (args.chunk - EXCLUDED)]
    pg, _, inputs, outputs = graph_and_nodes(layers)
    torch.manual_seed(args.seed)
    generator = torch.Generator().manual_seed(args.seed)
    order = torch.cat([torch.randperm(rows.shape[0], generator=generator) for _ in range(args.epochs)])
    d = rows.shape[1] // (2 * len(layers))
    start = time.perf_counter()
    dictionaries = []
    for i, layer in enumerate(layers):
        x = rows[:, i * d:(i + 1) * d]
        y = rows[:, (len(layers) + i) * d:(len(layers) + i + 1) * d]
        tc, steps = train_layer(x, y, args, layer, (inputs[i], outputs[i]), order)
        dictionaries.append(tc)
    train_seconds = time.perf_counter() - start
    dev = load_file(str(work / "dev.safetensors"))
    batches = [dev[f"dev_{i}"][None] for i in range(len(dev))]
    if args.fvu_only:
        return record(work, args, steps, rows.shape[0], train_seconds, start,
                      dev_fvu(pg, dictionaries, inputs, outputs, batches, work / "dev_rows.safetensors"), None)
    if not args.full_eval:
        return record(work, args, steps, rows.shape[0], train_seconds, start,
                      dev_scores(pg, dictionaries, inputs, outputs, batches, work / "dev_base.json"), None)
    scores = evaluate_layers(pg, per_layer_dictionaries(dictionaries), batches)
    per_layer = {str(layer): {"fvu": round(m.fvu, 4), "l0": round(m.l0, 2), "dead": round(m.dead_fraction, 3),
                              "ce_recovered": round(m.ce_loss_recovered, 4)}
                 for layer, m in zip(layers, scores.layers.values())}
    return record(work, args, steps, rows.shape[0], train_seconds, start, per_layer,
                  round(scores.all_spliced.ce_loss_recovered, 4))


def record(work: Path, args: argparse.Namespace, steps: int, train_rows: int, train_seconds: float, start: float,
           per_layer: dict[str, Any], together: float | None) -> dict[str, Any]:
    """The trial's JSON line, appended to ``work/trials.jsonl``."""
    settings = {key: getattr(args, key) for key in ("tokens", "epochs", "batch_rows", "lr", "k", "expansion",
                                                    "skip_init", "init_rows", "ridge", "warmup", "decay", "auxk",
                                                    "dead_after", "enc_scale", "seed")}
    result = {"settings": settings, "steps": steps, "train_rows": train_rows, "layers": per_layer,
              "together_ce_recovered": together, "train_minutes": round(train_seconds / 60, 2),
              "minutes": round((time.perf_counter() - start) / 60, 2)}
    with open(work / "trials.jsonl", "a", encoding="utf-8") as handle:
        handle.write(json.dumps(result) + "\n")
    return result


def dev_fvu(pg: Any, dictionaries: list[Any], inputs: list[str], outputs: list[str], documents: list[torch.Tensor],
            rows_path: Path) -> dict[str, Any]:
    """Per layer on ``documents`` (from position 2): FVU, L0 and dead fraction only (no CE: no forward pass once the
    documents' MLP inputs and outputs are kept in ``rows_path``)."""
    from gradpatch.capture import node_activations

    if not rows_path.is_file():
        with torch.no_grad():
            parts = [torch.cat([a[0, EXCLUDED:] for a in node_activations(pg, inputs + outputs, ids)], -1)
                     for ids in documents]
        save_file({"rows": torch.cat(parts).contiguous()}, str(rows_path))
    rows = load_file(str(rows_path))["rows"]
    d = rows.shape[1] // (2 * len(inputs))
    scores = {}
    with torch.no_grad():
        for i, (node, tc) in enumerate(zip(outputs, dictionaries)):
            x, y = rows[:, i * d:(i + 1) * d], rows[:, (len(inputs) + i) * d:(len(inputs) + i + 1) * d]
            z = tc.encode(x)
            error = float((tc.output(x, z) - y).double().pow(2).sum())
            variance = float((y.double() - y.double().mean(0)).pow(2).sum())
            scores[node.split(".")[1].split("_")[1]] = {
                "fvu": round(error / variance, 4), "l0": round(float((z > 0).sum(-1).float().mean()), 2),
                "dead": round(1 - float((z > 0).any(0).float().mean()), 3)}
    return scores


def dev_scores(pg: Any, dictionaries: list[Any], inputs: list[str], outputs: list[str], documents: list[torch.Tensor],
               base_path: Path) -> dict[str, Any]:
    """Per layer on ``documents`` (``[1, len]`` each, from position 2): FVU, L0, dead fraction and CE loss recovered
    with that layer spliced alone, as :func:`gradpatch.dictionaries.evaluate_layers` defines them; the model's CE and
    each layer's zero-ablated CE are computed once and kept in ``base_path`` (they do not depend on the trial)."""
    import torch.nn.functional as F

    from gradpatch.capture import node_activations
    from gradpatch.patches import CustomPatch, ZeroPatch
    from gradpatch.positions import Tokens

    positions = Tokens(slice(EXCLUDED, None))

    def ce(ids: torch.Tensor, patches: dict[str, Any]) -> float:
        with pg.patch(patches):
            logits = pg(input_ids=ids, use_cache=False).logits
        return float(F.cross_entropy(logits[0, :-1].float(), ids[0, 1:], reduction="sum"))

    with torch.no_grad():
        if base_path.is_file():
            base = json.loads(base_path.read_text())
        else:
            base = {"original": sum(ce(ids, {}) for ids in documents),
                    "zero": [sum(ce(ids, {node: ZeroPatch(slice=positions)}) for ids in documents)
                             for node in outputs]}
            base_path.write_text(json.dumps(base))
        spliced = [0.0] * len(outputs)
        sums = [{"error": 0.0, "ys": [], "active": 0.0, "fired": torch.zeros(d.d_sae, dtype=torch.bool)}
                for d in dictionaries]
        for ids in documents:
            acts = node_activations(pg, inputs + outputs, ids)
            for i, tc in enumerate(dictionaries):
                x, y = acts[i], acts[len(inputs) + i]
                z = tc.encode(x)
                prediction = tc.output(x, z)
                spliced[i] += ce(ids, {outputs[i]: CustomPatch(  # the op gets and returns positions 2.. only
                    custom_op=lambda o, v=prediction[:, EXCLUDED:]: v.to(o.dtype), slice=positions,
                    requires_clone=False)})
                kept = slice(EXCLUDED, None)
                sums[i]["error"] += float((prediction[0, kept] - y[0, kept]).double().pow(2).sum())
                sums[i]["ys"].append(y[0, kept].double())
                sums[i]["active"] += float((z[0, kept] > 0).sum())
                sums[i]["fired"] |= (z[0, kept] > 0).any(0)
    scores = {}
    for i, (node, one) in enumerate(zip(outputs, sums)):
        ys = torch.cat(one["ys"])
        variance = float((ys - ys.mean(0)).pow(2).sum())
        span = base["zero"][i] - base["original"]
        layer = node.split(".")[1].split("_")[1]
        scores[layer] = {"fvu": round(one["error"] / variance, 4), "l0": round(one["active"] / ys.shape[0], 2),
                         "dead": round(1 - float(one["fired"].float().mean()), 3),
                         "ce_recovered": round((base["zero"][i] - spliced[i]) / span, 4)}
    return scores


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("step", choices=["cache", "trial"])
    parser.add_argument("--work", required=True, help="folder of the cached rows and trials.jsonl")
    parser.add_argument("--layers", type=int, nargs="+", default=[3, 12, 24])
    parser.add_argument("--tokens", type=int, default=32768, help="training tokens (cache: cached; trial: used)")
    parser.add_argument("--chunk", type=int, default=128)
    parser.add_argument("--eval-tokens", type=int, default=256, help="the recipe's held-out tokens (skipped)")
    parser.add_argument("--dev-tokens", type=int, default=1024, help="development tokens scored")
    parser.add_argument("--dev-documents", type=int, default=200, help="the corpus's last documents, for dev")
    parser.add_argument("--batch-rows", type=int, default=1008, help="rows (tokens) per optimizer step")
    parser.add_argument("--epochs", type=int, default=1, help="passes over the --tokens rows, each in a new order")
    parser.add_argument("--lr", type=float, default=0.002)
    parser.add_argument("--k", type=int, default=32)
    parser.add_argument("--expansion", type=int, default=2)
    parser.add_argument("--skip-init", choices=["zero", "least_squares"], default="zero")
    parser.add_argument("--init-rows", type=int, default=2048, help="rows of the least-squares skip fit")
    parser.add_argument("--ridge", type=float, default=1e-4)
    parser.add_argument("--warmup", type=float, default=0.05, help="warm-up: a fraction of the steps, or steps")
    parser.add_argument("--decay", type=float, default=0.2, help="the last fraction of steps decayed to 0")
    parser.add_argument("--auxk", type=float, default=1 / 32)
    parser.add_argument("--dead-after", type=int, default=10000)
    parser.add_argument("--enc-scale", type=float, default=1.0, help="initial encoder weights scaled by this")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fvu-only", action="store_true", help="score FVU, L0 and dead fraction only (no CE)")
    parser.add_argument("--full-eval", action="store_true",
                        help="score with evaluate_layers (adds the layers spliced at once; 3x the passes)")
    args = parser.parse_args()
    torch.set_grad_enabled(True)
    emit(cache(args) if args.step == "cache" else trial(args), indent=None)


if __name__ == "__main__":
    main()
