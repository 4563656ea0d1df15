"""Time per fact of the value search, batched (MEMIT) against one fact at a time (ROME); prints JSON.

Measured in one run, on the same facts' objective (ROME's eq. 4: target NLL over the context prompts, KL on
"{subject} is a", weight decay, clamp; the same context prefixes, steps, learning rate and early stop):

- ``one_at_a_time``: ``--single`` facts, each searched alone with :class:`editors.ValueObjective` and
  :func:`editors.optimize_value` (ROME's path: one forward and backward over that fact's prompts per step);
- ``batch_of_one``: the same facts, each alone through the batched code (:func:`editors.value.batch_search.optimize_values`
  with one fact): separates what batching gains from what the batched code's other savings gain (logits read only
  where the terms need them; the prefix KV cache: each step runs only the tokens from the subject's last one on);
- ``batched``: ``--batch`` facts searched together (one forward and backward per step carries every fact's rows,
  in passes of at most ``--max-tokens`` tokens).

``speedup = one_at_a_time.per_fact_s / batched.per_fact_s`` (target ≥ 10 at batch 100 on CPU). Per-fact step counts
of the facts searched both ways are compared (``same_steps``): the batched search stops each fact where its own
search stops. Keys and ``v₀`` are computed once beforehand and not timed; no statistics are needed.

Run: ``.venv/bin/python -m benchmarks.editing.memit_edit [--cases FILE] [--batch 100] [--single 10] [--tiny]
[--value-dtype bfloat16] [--device cuda]``. Without ``--cases`` it reads ``demos/rome/facts.json`` (the fact bank)
and cycles ``demos/rome/cases.json`` if that is missing. ``--tiny`` uses a random tiny Llama and made-up facts
(seconds). ``--value-dtype bfloat16`` runs all three parts on a bfloat16 copy of the model
(:mod:`editors.value.search_copy`; keys and ``v₀`` still from the float32 model), the batched code from the residual
stream after the layer's block as MEMIT runs it there (:mod:`editors.passes.tail_pass`). ``--device cuda`` runs on a GPU
(the ≥ 10× target is for the CPU; docs/memit.md gives both).
"""

from __future__ import annotations

import argparse
import platform
import sys
import time

import torch

from benchmarks.harness import ROOT, emit
from editors import EditRequest, ValueObjective, load_cases, optimize_value, resolve_layer
from editors.value.batch_search import optimize_values
from editors.value.batch_objective import BatchValueObjective, search_attention
from editors.statistics.keys import context_activations, load_or_generate_prefixes
from editors.memit import DEFAULT_SMOLLM2_NODES, residual_node_of
from editors.config import MEMITConfig
from editors.value.search_copy import SearchCopy, search_dtype
from editors.statistics.second_moment import default_cache_dir, statistics_fingerprint
from editors.passes.tail_pass import tail_pass_for
from gradpatch.testing import TOY_SENTENCES, byte_level_tokenizer, tiny_llama
from gradpatch import PatchableGraph



def _requests(path: str | None, n: int) -> list[EditRequest]:
    if path is None:
        bank = ROOT / "demos" / "rome" / "facts.json"
        path = str(bank if bank.is_file() else ROOT / "demos" / "rome" / "cases.json")
    cases = load_cases(path)
    return [cases[i % len(cases)].request for i in range(n)]


def _tiny_requests(n: int) -> list[EditRequest]:
    words = sorted({w.strip(".,") for s in TOY_SENTENCES for w in s.split() if len(w.strip(".,")) > 2})
    return [EditRequest(prompt="I think the answer is {}", subject=words[i % len(words)],
                        target_new=words[(i * 7 + 3) % len(words)]) for i in range(n)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=None, help="CounterFact JSON whose requests are searched")
    parser.add_argument("--batch", type=int, default=100, help="facts searched together (default %(default)s)")
    parser.add_argument("--single", type=int, default=10, help="facts searched one at a time (default %(default)s)")
    parser.add_argument("--node", default=None, help="layer whose output gets δ (default: MEMIT's last layer)")
    parser.add_argument("--max-tokens", type=int, default=None, help="tokens per forward/backward pass")
    parser.add_argument("--tiny", action="store_true", help="a random tiny Llama instead of SmolLM2-135M")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu; the target is for CPU)")
    parser.add_argument("--value-dtype", default=None, choices=("bfloat16",),
                        help="search on a copy of the model in this dtype (all three alike; editors.value.search_copy)")
    args = parser.parse_args(argv)

    config = MEMITConfig(progress=False)
    max_tokens = args.max_tokens or config.max_tokens
    if args.tiny:
        tokenizer = byte_level_tokenizer()
        model = tiny_llama(len(tokenizer)).to(args.device)
        node = args.node or "model.layers_1.mlp.down_proj"
        requests = _tiny_requests(args.batch)
        config.clamp_factor, config.context_length_params = 500.0, ((5, 4), (10, 4))
    else:
        from gradpatch.files.loaders import load_embedded_model

        model, tokenizer = load_embedded_model(device=args.device)
        node = args.node or DEFAULT_SMOLLM2_NODES[-1]
        requests = _requests(args.cases, args.batch)
    pg = PatchableGraph(model, torch.randint(0, len(tokenizer), (2, 8), device=args.device), use_cache=False).eval()
    layer = resolve_layer(pg, node)
    templates = load_or_generate_prefixes(pg, tokenizer, None if args.tiny else default_cache_dir(),
                                          statistics_fingerprint(pg, skip=(node,)),
                                          length_params=config.context_length_params,
                                          seed=config.template_seed).subset(config.value_prefixes)
    keys = context_activations(pg, tokenizer, [layer.input_node], [(r.prompt, r.subject) for r in requests],
                               templates, max_tokens=max_tokens)[0].mean(dim=1)  # [F, d_in]
    with torch.no_grad():
        v_init = layer.forward_value(keys)  # [F, d_out]
    search = {"steps": config.steps, "lr": config.lr, "early_stop_loss": config.early_stop_loss}
    dtype = search_dtype(args.value_dtype)
    if dtype is not None:  # keys and v₀ above come from the float32 model, as in MEMIT.compute
        pg = SearchCopy(pg, tokenizer, dtype).graph()
        layer = resolve_layer(pg, node)
    terms = {"kl_factor": config.kl_factor, "weight_decay": config.weight_decay, "clamp_factor": config.clamp_factor}
    n_single = min(args.single, len(requests))

    on_gpu = torch.device(args.device).type == "cuda"
    synchronize = torch.cuda.synchronize if on_gpu else (lambda: None)
    synchronize()
    t0 = time.perf_counter()
    with search_attention(pg):  # ROME's path gets the attention backend the batched search uses
        alone = [optimize_value(ValueObjective(pg, tokenizer, layer, requests[i], templates, v_init[i], **terms),
                                **search) for i in range(n_single)]
    synchronize()
    t1 = time.perf_counter()
    def tail():  # MEMIT's batched search on its copy runs from the residual stream after the layer's block
        return tail_pass_for(pg, residual_node_of(layer)) if dtype is not None else None

    ones = [optimize_values(BatchValueObjective(pg, tokenizer, layer, [requests[i]], templates, v_init[i : i + 1],
                                                max_tokens=max_tokens, tail=tail(), **terms), **search)[0]
            for i in range(n_single)]
    synchronize()
    t2 = time.perf_counter()
    objective = BatchValueObjective(pg, tokenizer, layer, requests, templates, v_init, max_tokens=max_tokens,
                                    tail=tail(), **terms)
    together = optimize_values(objective, **search)
    synchronize()
    t3 = time.perf_counter()

    def summary(results: list, seconds: float) -> dict:
        return {"facts": len(results), "seconds": seconds, "per_fact_s": seconds / max(len(results), 1),
                "mean_steps": sum(r.steps for r in results) / max(len(results), 1),
                "converged": sum(r.converged(config.early_stop_loss) for r in results)}

    single, batch_of_one, batched = summary(alone, t1 - t0), summary(ones, t2 - t1), summary(together, t3 - t2)
    result = {
        "benchmark": "memit_edit",
        "model": "tiny-llama" if args.tiny else "embedded:SmolLM2-135M-Instruct",
        "node": node,
        "value_prefixes": len(templates),
        "value_prompts_per_fact": len(templates) + 1,
        "max_tokens": max_tokens,
        "value_dtype": args.value_dtype,
        "tail_pass": objective.tail is not None,  # the batched search ran from the block after the layer
        "one_at_a_time": single,
        "batch_of_one": batch_of_one,
        "batched": batched,
        "speedup": single["per_fact_s"] / batched["per_fact_s"],
        "speedup_vs_batch_of_one": batch_of_one["per_fact_s"] / batched["per_fact_s"],
        "target_speedup": 10.0,
        "ok": single["per_fact_s"] / batched["per_fact_s"] >= 10.0,
        "same_steps": [a.steps for a in alone] == [b.steps for b in together[:n_single]],
        "max_delta_difference": max(float((a.delta - b.delta).abs().max()) for a, b in zip(alone, together)),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "machine": platform.machine(),
        "device": torch.cuda.get_device_name() if on_gpu else "cpu",
    }
    emit(result, device=args.device, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
