"""The pyreft side of benchmarks/interventions/reft_pyreft.py; runs in a separate virtualenv with pyreft 0.1.0 (never
imported by the project). Reads a model folder (config.json, weights.safetensors) and IN.safetensors (token ids,
positions, R, W, b, the seed of R's assignment, a hidden batch; all in one dtype, which the model takes too); writes
OUT.safetensors: pyreft's LoreftIntervention output on the hidden batch and its R, the model's logits and block
output with the intervention at a layer, the losses and seconds per training step, the resident memory before the
steps and its peak during them (MiB, benchmarks/harness.py).

    .peers/pyreft/bin/python -m benchmarks.peers.pyreft.reft_side MODEL_DIR IN.safetensors OUT.safetensors LAYER STEPS
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pyreft
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from benchmarks.harness import median, timed_steps


def main() -> None:
    model_dir, source, target, layer, steps = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
    data = load_file(source)
    rotation, weight, bias = data["R"], data["W"], data["b"]  # R [r, d]; pyreft's rotate_layer.weight is R^T
    rank, width = rotation.shape
    dtype = rotation.dtype
    torch.manual_seed(0)
    config = LlamaConfig(**json.loads(Path(model_dir, "config.json").read_text()))
    model = LlamaForCausalLM(config).to(dtype)  # the dtype first: load_state_dict copies into the existing dtype
    missing, unexpected = model.load_state_dict(load_file(f"{model_dir}/weights.safetensors"), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.tie_weights()
    model.eval()
    intervention = pyreft.LoreftIntervention(embed_dim=width, low_rank_dimension=rank, dtype=dtype).to(dtype)
    with torch.random.fork_rng():  # the right inverse draws R's completion: the same seed as gradpatch's side
        torch.manual_seed(int(data["seed"]))
        intervention.rotate_layer.weight = rotation.T.contiguous()
    with torch.no_grad():
        intervention.learned_source.weight.copy_(weight)
        intervention.learned_source.bias.copy_(bias)
    # A fresh (aligned) copy: MKL's float32 matmul rounds differently for a buffer not 16-byte aligned, which a
    # tensor read from a safetensors file may be
    out = {"edit": intervention(data["h"].clone()).detach(), "R": intervention.rotate_layer.weight.detach().T}
    config = pyreft.ReftConfig(representations=[{"layer": layer, "component": "block_output",
                                                 "low_rank_dimension": rank, "intervention": intervention}])
    reft = pyreft.get_reft_model(model, config, set_device=False)
    ids, positions = data["input_ids"], data["positions"].tolist()
    locations = {"sources->base": (None, [[positions] * ids.shape[0]])}
    # The logits from the final normed hidden state: transformers 4.45 returns them cast to float32
    with torch.no_grad():
        out["base_logits"] = model.lm_head(model(input_ids=ids, output_hidden_states=True).hidden_states[-1])
        _, patched = reft({"input_ids": ids, "output_hidden_states": True}, unit_locations=locations)
        out["logits"] = model.lm_head(patched.hidden_states[-1])
    out["hidden"] = patched.hidden_states[layer + 1]  # the next layer's input: the block output after the edit
    del patched
    optimizer = torch.optim.Adam(reft.get_trainable_parameters() if hasattr(reft, "get_trainable_parameters")
                                 else intervention.parameters(), lr=1e-3)
    labels, prompt = data["input_ids"].clone(), int(data["prompt_length"])

    def loss_of(_: int) -> torch.Tensor:
        _, result = reft({"input_ids": ids}, unit_locations=locations)
        logits = result.logits[:, prompt - 1:-1]
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, prompt:].reshape(-1))

    run = timed_steps(optimizer, range(steps), loss_of)
    out["peak_mib_during_steps"] = torch.tensor(run.peak_mib, dtype=torch.float64)
    out["resident_mib_before_steps"] = torch.tensor(run.resident_mib_before, dtype=torch.float64)
    out["losses"] = torch.tensor(run.losses)
    out["seconds_per_step"] = torch.tensor(median(run.seconds))
    out["cpu_seconds_per_step"] = torch.tensor(median(run.cpu_seconds))
    save_file({k: v.contiguous() for k, v in out.items()}, target)


if __name__ == "__main__":
    main()
