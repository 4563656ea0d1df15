"""LoReFT against pyreft 0.1.0: the same R, W, b give the same outputs; seconds per training step on one batch.

Runs the embedded SmolLM2-135M-Instruct (float32, its weights and config written into a temporary folder from which
pyreft's transformers rebuilds it) in two processes: here with :class:`gradpatch.LoReFTPatch` at
``model.layers_{L}.output`` (the decoder layer's output, pyreft's ``block_output``) and in pyreft's virtualenv with
``pyreft.LoreftIntervention`` (benchmarks/pyreft_side.py). Prints JSON: the largest differences of the intervention
on a random hidden batch and of the logits with the intervention, the logits' difference without it (the two
transformers versions' own agreement), the median seconds per step (forward + backward + Adam, same batch, same
positions; CPU time, which the other processes on a shared machine disturb less than wall time) and the ratio.

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python benchmarks/reft_pyreft.py --python /work/venvs/pyreft/bin/python
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from gradpatch import LoReFTPatch, PatchableGraph, ProbePatch
from gradpatch.models import load_embedded_model
from gradpatch.reft import reft_patch_map


#: The LlamaConfig fields pyreft's transformers (4.45) needs to rebuild the model (5.24 renamed rope_theta).
_CONFIG_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                  "vocab_size", "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings", "head_dim",
                  "hidden_act", "attention_bias", "mlp_bias")


def _save_for_pyreft(model: torch.nn.Module, folder: str) -> None:
    """The dequantized float32 weights (safetensors, tied lm_head left out) and the config fields (JSON)."""
    config = {name: getattr(model.config, name) for name in _CONFIG_FIELDS}
    config["rope_theta"] = (getattr(model.config, "rope_parameters", None) or {}).get(
        "rope_theta", getattr(model.config, "rope_theta", None))
    Path(folder, "config.json").write_text(json.dumps(config))
    save_file({name: t.detach().clone().contiguous() for name, t in model.state_dict().items()
               if name != "lm_head.weight"}, f"{folder}/weights.safetensors")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", default="/work/venvs/pyreft/bin/python", help="python of pyreft's virtualenv")
    parser.add_argument("--layer", type=int, default=10)
    parser.add_argument("--rank", type=int, default=4)
    parser.add_argument("--positions", default="f3+l3")
    parser.add_argument("--steps", type=int, default=7)
    args = parser.parse_args()
    torch.manual_seed(0)
    model, tokenizer = load_embedded_model()
    model.eval().requires_grad_(False)  # frozen, as ReFTModule's graph and pyreft's get_reft_model leave it
    width = model.config.hidden_size
    patch = LoReFTPatch(width, args.rank, positions=args.positions)
    with torch.no_grad():
        patch.projection.weight.normal_(0, 0.05)
        patch.projection.bias.normal_(0, 0.5)
    prompt = tokenizer("Which country is the city of Lyon in? Answer in one word.\n")["input_ids"]
    response = tokenizer("France", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    ids = torch.tensor([prompt + response] * 4)
    positions = patch.positions.columns(len(prompt))
    h = torch.randn(8, width)
    rotation = patch.R.detach().clone()
    node = f"model.layers_{args.layer}.output"
    with tempfile.TemporaryDirectory() as folder:
        _save_for_pyreft(model, folder)
        save_file({"R": patch.R.detach().contiguous(), "W": patch.projection.weight.detach().contiguous(),
                   "b": patch.projection.bias.detach().contiguous(), "h": h, "input_ids": ids,
                   "positions": torch.tensor(positions), "prompt_length": torch.tensor(len(prompt))},
                  f"{folder}/in.safetensors")
        side = str(Path(__file__).with_name("pyreft_side.py"))
        subprocess.run([args.python, side, folder, f"{folder}/in.safetensors", f"{folder}/out.safetensors",
                        str(args.layer), str(args.steps)], check=True)
        theirs = load_file(f"{folder}/out.safetensors")
    pg = PatchableGraph(model, ids, use_cache=False)
    with torch.no_grad():
        base = pg(ids, use_cache=False).logits
        probe = ProbePatch()
        with pg.patch({node: [*reft_patch_map({node: patch}, [len(prompt)] * len(ids))[node], probe]}):
            logits = pg(ids, use_cache=False).logits
        hidden = probe.activation
        edit = patch.edit(h)
    optimizer = torch.optim.Adam(patch.parameters(), lr=1e-3)
    times, cpu_times, losses = [], [], []
    for _ in range(args.steps):
        start, cpu = time.perf_counter(), time.process_time()
        with pg.patch(reft_patch_map({node: patch}, [len(prompt)] * len(ids))):
            out = pg(ids, use_cache=False).logits[:, len(prompt) - 1:-1]
        loss = torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), ids[:, len(prompt):].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - cpu)
        losses.append(float(loss.detach()))
    ours, ours_cpu = sorted(times)[len(times) // 2], sorted(cpu_times)[len(cpu_times) // 2]
    print(json.dumps({
        "layer": args.layer, "rank": args.rank, "positions": args.positions, "batch": list(ids.shape),
        "max_abs_diff_R": float((rotation - theirs["R"]).abs().max()),
        "max_abs_diff_intervention": float((edit - theirs["edit"]).abs().max()),
        "max_abs_diff_logits_intervened": float((logits - theirs["logits"]).abs().max()),
        "max_abs_diff_logits_base": float((base - theirs["base_logits"]).abs().max()),
        "intervention_changes_logits_by": float((logits - base).abs().max()),
        "max_abs_logit": float(theirs["logits"].abs().max()),
        "max_abs_diff_intervened_hidden": float((hidden - theirs["hidden"]).abs().max()),
        "max_abs_intervened_hidden": float(theirs["hidden"].abs().max()),
        "abs_diff_first_step_loss": abs(losses[0] - float(theirs["losses"][0])),
        "losses_gradpatch": losses, "losses_pyreft": theirs["losses"].tolist(),
        "cpu_seconds_per_step_gradpatch": ours_cpu,
        "cpu_seconds_per_step_pyreft": float(theirs["cpu_seconds_per_step"]),
        "cpu_ratio_gradpatch_over_pyreft": ours_cpu / float(theirs["cpu_seconds_per_step"]),
        "wall_seconds_per_step_gradpatch": ours, "wall_seconds_per_step_pyreft": float(theirs["seconds_per_step"])},
        indent=2))


if __name__ == "__main__":
    main()
