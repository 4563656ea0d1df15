"""LoReFT against pyreft 0.1.0: the same R, W, b give the same outputs; seconds and peak memory per training step.

Runs the embedded SmolLM2-135M-Instruct (in ``--dtype``; its weights and config written into a temporary folder
from which pyreft's transformers rebuilds it) with :class:`gradpatch.LoReFTPatch` at ``model.layers_{L}.output``
(the decoder layer's output, pyreft's ``block_output``) here, and with ``pyreft.LoreftIntervention`` in pyreft's
virtualenv (benchmarks/peers/pyreft/reft_side.py). Both sides assign the same R through their orthogonal
parametrization's right inverse with the same seed, so both hold the same R bits and the same parametrization state
(benchmarks/interventions/reft_pyreft_ours.py, ``assign_rotation``); beside, how much R and the logits move through that
assignment's rounding alone (R before it vs after it, both gradpatch).

Prints JSON: the largest differences of R, of the intervention on a random hidden batch, of the intervened block
output and of the logits with the intervention, the logits' difference without it (the two transformers versions'
own agreement); then the training steps (forward + backward + Adam, same batch, same positions), each side in a
process of its own (benchmarks/interventions/reft_pyreft_ours.py, benchmarks/peers/pyreft/reft_side.py): median
seconds per step (CPU time, which the other processes on a shared machine disturb less than wall time, and wall time),
the resident memory before the steps and its peak during them (MiB, the kernel's high-water mark reset before the
steps), and ratios.

    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.interventions.reft_pyreft   # pyreft from .peers/pyreft
    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.interventions.reft_pyreft --dtype float64
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from benchmarks.harness import emit, peer_python, run_module
from benchmarks.interventions.reft_pyreft_ours import loreft_from
from gradpatch import LoReFTPatch, PatchableGraph, ProbePatch
from gradpatch.files.loaders import load_embedded_model
from gradpatch.interventions.reft import reft_patch_map

#: The LlamaConfig fields pyreft's transformers (4.45) needs to rebuild the model (5.24 renamed rope_theta).
_CONFIG_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                  "vocab_size", "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings", "head_dim",
                  "hidden_act", "attention_bias", "mlp_bias")


def save_for_pyreft(model: torch.nn.Module, folder: str) -> None:
    """The dequantized weights in their dtype (safetensors, tied lm_head left out) and the config fields (JSON)."""
    config = {name: getattr(model.config, name) for name in _CONFIG_FIELDS}
    config["rope_theta"] = (getattr(model.config, "rope_parameters", None) or {}).get(
        "rope_theta", getattr(model.config, "rope_theta", None))
    Path(folder, "config.json").write_text(json.dumps(config))
    save_file({name: t.detach().clone().contiguous() for name, t in model.state_dict().items()
               if name != "lm_head.weight"}, f"{folder}/weights.safetensors")


def _steps_report(ours: dict, theirs: dict[str, torch.Tensor]) -> dict:
    """Seconds and memory of both sides' training steps, and the ratios gradpatch / pyreft."""
    ours_growth = ours["peak_mib_during_steps"] - ours["resident_mib_before_steps"]
    theirs_growth = float(theirs["peak_mib_during_steps"] - theirs["resident_mib_before_steps"])
    return {
        "losses_gradpatch": ours["losses"], "losses_pyreft": theirs["losses"].tolist(),
        "cpu_seconds_per_step_gradpatch": ours["cpu_seconds_per_step"],
        "cpu_seconds_per_step_pyreft": float(theirs["cpu_seconds_per_step"]),
        "cpu_ratio_gradpatch_over_pyreft": ours["cpu_seconds_per_step"] / float(theirs["cpu_seconds_per_step"]),
        "wall_seconds_per_step_gradpatch": ours["seconds_per_step"],
        "wall_seconds_per_step_pyreft": float(theirs["seconds_per_step"]),
        "resident_mib_before_steps_gradpatch": ours["resident_mib_before_steps"],
        "resident_mib_before_steps_pyreft": float(theirs["resident_mib_before_steps"]),
        "peak_mib_during_steps_gradpatch": ours["peak_mib_during_steps"],
        "peak_mib_during_steps_pyreft": float(theirs["peak_mib_during_steps"]),
        "peak_growth_mib_gradpatch": ours_growth, "peak_growth_mib_pyreft": theirs_growth,
        "peak_growth_ratio_gradpatch_over_pyreft": ours_growth / theirs_growth}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", help="python of pyreft's virtualenv (default: .peers/pyreft/bin/python)")
    parser.add_argument("--layer", type=int, default=10)
    parser.add_argument("--rank", type=int, default=4)
    parser.add_argument("--positions", default="f3+l3")
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--dtype", choices=("float32", "float64"), default="float32", help="of both sides")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    model, tokenizer = load_embedded_model(dtype=dtype)
    model.eval().requires_grad_(False)  # frozen, as ReFTModule's graph and pyreft's get_reft_model leave it
    width = model.config.hidden_size
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # R orthonormal to the dtype's precision from the start, not a cast float32 one
    try:
        initial = LoReFTPatch(width, args.rank, positions=args.positions)
    finally:
        torch.set_default_dtype(default_dtype)
    with torch.no_grad():
        initial.projection.weight.normal_(0, 0.05)
        initial.projection.bias.normal_(0, 0.5)
    prompt = tokenizer("Which country is the city of Lyon in? Answer in one word.\n")["input_ids"]
    response = tokenizer("France", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    ids = torch.tensor([prompt + response] * 4)
    data = {"R": initial.R.detach().contiguous(), "W": initial.projection.weight.detach(),
            "b": initial.projection.bias.detach(), "h": torch.randn(8, width, dtype=dtype), "input_ids": ids,
            "positions": torch.tensor(initial.positions.columns(len(prompt))),
            "prompt_length": torch.tensor(len(prompt)), "seed": torch.tensor(1234)}
    patch = loreft_from(data, args.positions)
    node = f"model.layers_{args.layer}.output"
    with tempfile.TemporaryDirectory() as folder:
        save_for_pyreft(model, folder)
        save_file(data, f"{folder}/in.safetensors")
        run_module(peer_python("pyreft", args.python), "benchmarks.peers.pyreft.reft_side",
                   [folder, f"{folder}/in.safetensors", f"{folder}/out.safetensors", str(args.layer), str(args.steps)])
        theirs = load_file(f"{folder}/out.safetensors")
        run_module(sys.executable, "benchmarks.interventions.reft_pyreft_ours",
                   [f"{folder}/in.safetensors", f"{folder}/ours.json", str(args.layer), str(args.steps),
                    args.positions])
        ours = json.loads(Path(folder, "ours.json").read_text())
    pg = PatchableGraph(model, ids, use_cache=False)
    with torch.no_grad():
        base = pg(ids, use_cache=False).logits
        probe = ProbePatch()
        with pg.patch({node: [*reft_patch_map({node: patch}, [len(prompt)] * len(ids))[node], probe]}):
            logits = pg(ids, use_cache=False).logits
        edit = patch.edit(data["h"].clone())
        # R as the initial patch's parametrization gives it, before the right inverse's rounding
        with pg.patch(reft_patch_map({node: initial}, [len(prompt)] * len(ids))):
            logits_unassigned = pg(ids, use_cache=False).logits
    emit({
        "dtype": args.dtype, "layer": args.layer, "rank": args.rank, "positions": args.positions,
        "batch": list(ids.shape),
        "max_abs_diff_R": float((patch.R.detach() - theirs["R"]).abs().max()),
        "max_abs_diff_intervention": float((edit - theirs["edit"]).abs().max()),
        "max_abs_diff_intervened_hidden": float((probe.activation - theirs["hidden"]).abs().max()),
        "max_abs_intervened_hidden": float(theirs["hidden"].abs().max()),
        "max_abs_diff_logits_intervened": float((logits - theirs["logits"]).abs().max()),
        "max_abs_diff_logits_base": float((base - theirs["base_logits"]).abs().max()),
        "max_abs_diff_R_before_vs_after_assignment": float((initial.R - patch.R).detach().abs().max()),
        "max_abs_diff_logits_R_before_vs_after_assignment": float((logits_unassigned - logits).abs().max()),
        "intervention_changes_logits_by": float((logits - base).abs().max()),
        "max_abs_logit": float(theirs["logits"].abs().max()),
        "abs_diff_first_step_loss": abs(ours["losses"][0] - float(theirs["losses"][0])),
        **_steps_report(ours, theirs)})


if __name__ == "__main__":
    main()
