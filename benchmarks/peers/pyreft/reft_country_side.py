"""The pyreft side of benchmarks/interventions/reft_country_pyreft.py; runs in pyreft 0.1.0's virtualenv (never
imported by the project). Trains pyreft's LoreftIntervention on the batches gradpatch trained on and generates on the
held-out prompts.

Reads a model folder (config.json, weights.safetensors, as benchmarks/interventions/reft_pyreft.py writes it) and
IN.safetensors: the settings (``settings``: JSON bytes: layer, rank, lr, max_new_tokens, pad and eos ids), the initial
parametrization state of R (``original`` ``[r, d]``, ``base`` ``[d, d]``: gradpatch's wide R; pyreft's Rᵀ is the
transposed tall one, so ``original`` is copied transposed and ``base`` as it is, and both R are then the same
bits), W, b, and per batch ``train.{i}.*`` / ``nll.{j}.*`` / ``generate.{j}.*`` (left-padded ``input_ids``,
``attention_mask``, ``position_ids``, the intervened columns ``locations`` ``[B, P]``, ``response_lengths``).
Writes OUT.safetensors: the losses and seconds per step, the resident memory before training and its peak during it
(MiB, benchmarks/harness.py), the held-out NLL sum and token count, the generated token ids per batch.

    .peers/pyreft/bin/python -m benchmarks.peers.pyreft.reft_country_side MODEL_DIR IN.safetensors OUT.safetensors
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pyreft
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from benchmarks.harness import timed_steps


def _batches(data: dict[str, torch.Tensor], kind: str) -> list[dict[str, torch.Tensor]]:
    count = len({key.split(".")[1] for key in data if key.startswith(kind + ".")})
    return [{key.split(".")[2]: data[key] for key in data if key.startswith(f"{kind}.{i}.")} for i in range(count)]


def _response_log_probs(reft: pyreft.ReftModel, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probabilities of the response tokens (the last ``response_lengths`` columns of each row), as gradpatch's
    ``ReFTModule.token_log_probs``: summed log-probabilities and the token count."""
    ids = batch["input_ids"]
    width, lengths = ids.shape[1], batch["response_lengths"]
    longest = int(lengths.max())
    _, out = reft({"input_ids": ids, "attention_mask": batch["attention_mask"], "position_ids": batch["position_ids"]},
                  unit_locations={"sources->base": (None, [batch["locations"].tolist()])})
    log_probs = torch.log_softmax(out.logits[:, width - longest - 1:width - 1].float(), dim=-1)
    picked = log_probs.gather(-1, ids[:, width - longest:, None])[..., 0]
    mask = (torch.arange(longest)[None, :] >= longest - lengths[:, None]).float()
    return (picked * mask).sum(), mask.sum()


def main() -> None:
    model_dir, source, target = sys.argv[1], sys.argv[2], sys.argv[3]
    data = load_file(source)
    settings = json.loads(bytes(data["settings"].tolist()).decode())
    torch.manual_seed(0)
    config = LlamaConfig(**json.loads(Path(model_dir, "config.json").read_text()))
    model = LlamaForCausalLM(config)
    missing, unexpected = model.load_state_dict(load_file(f"{model_dir}/weights.safetensors"), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.tie_weights()
    model.eval()
    intervention = pyreft.LoreftIntervention(embed_dim=config.hidden_size, low_rank_dimension=settings["rank"],
                                             dtype=torch.float32)
    with torch.no_grad():
        state = intervention.rotate_layer.parametrizations.weight
        state.original.copy_(data["original"].T)
        state[0].base.copy_(data["base"])
        intervention.learned_source.weight.copy_(data["W"])
        intervention.learned_source.bias.copy_(data["b"])
    reft = pyreft.get_reft_model(model, pyreft.ReftConfig(representations=[{
        "layer": settings["layer"], "component": "block_output", "low_rank_dimension": settings["rank"],
        "intervention": intervention}]), set_device=False)
    out = {"R": intervention.rotate_layer.weight.detach().T.contiguous()}
    optimizer = torch.optim.AdamW(list(intervention.parameters()), lr=settings["lr"], weight_decay=0.0)

    def loss_of(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        total, tokens = _response_log_probs(reft, batch)
        return -total / tokens

    run = timed_steps(optimizer, _batches(data, "train"), loss_of)
    out.update(peak_mib_during_training=torch.tensor(run.peak_mib, dtype=torch.float64),
               resident_mib_before_training=torch.tensor(run.resident_mib_before, dtype=torch.float64),
               losses=torch.tensor(run.losses), seconds=torch.tensor(run.seconds),
               cpu_seconds=torch.tensor(run.cpu_seconds))
    with torch.no_grad():
        sums = [_response_log_probs(reft, batch) for batch in _batches(data, "nll")]
        out["heldout_nll_sum"] = -sum(s for s, _ in sums)
        out["heldout_tokens"] = sum(t for _, t in sums)
        for j, batch in enumerate(_batches(data, "generate")):
            _, generated = reft.generate(
                {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]},
                unit_locations={"sources->base": (None, [batch["locations"].tolist()])}, intervene_on_prompt=True,
                max_new_tokens=settings["max_new_tokens"], do_sample=False, pad_token_id=settings["pad"],
                eos_token_id=settings["eos"])
            out[f"generated.{j}"] = generated[:, batch["input_ids"].shape[1]:].contiguous()
    save_file(out, target)


if __name__ == "__main__":
    main()
