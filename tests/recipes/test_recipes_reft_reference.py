"""ReFTModule, the PatchTrainingModule whose patches edit the representation itself: trained under Lightning against the
same training written by hand in this test (the model's own forward with a hook applying LoReFT at the prompt's
positions or adding BiPO's signed steering vector, the losses and AdamW written here), tiny random Llama."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from lightning.pytorch import Callback, Trainer
from torch import nn

from recipes import (BiPOObjective, ContinuationDataModule, InterventionModule, PatchTrainingModule,
                     PreferenceDataModule)
from recipes import ReFTModule
from recipes.testing import tiny_backbone
from recipes.tokens import left_pad

NODE, LAYER = "model.layers_1.output", 1
CONTINUATIONS = [{"prompt": f"the city {city} is in the country", "response": country}
                 for city, country in {"Paris": "France", "Rome": "Italy", "Berlin": "Germany",
                                       "Madrid": "Spain"}.items()]
PREFERENCES = [{"prompt": f"I feel the {thing} was", "chosen": "good happy", "rejected": "bad sad"}
               for thing in ("movie", "food", "music", "weather")]
BATCH, STEPS = 2, 6


class _Steps(Callback):
    """Each step's loss and (BiPO) direction."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.directions: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["terms"]["loss"]))
        if "direction" in outputs["terms"]:
            self.directions.append(float(outputs["terms"]["direction"]))


def _fit(module: ReFTModule, data, steps: int) -> _Steps:
    recorder = _Steps()
    Trainer(max_steps=steps, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
            callbacks=[recorder]).fit(module, datamodule=data)
    return recorder


def _write(path: Path, records: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def _batch(tokenizer, prompts: list[str], responses: list[str]) -> tuple[dict[str, torch.Tensor], list[int], list[int]]:
    """Left-padded prompt (special tokens) + response + EOS; the prompt lengths and the response lengths (+ EOS)."""
    heads = [tokenizer(p)["input_ids"] for p in prompts]
    tails = [tokenizer(r, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for r in responses]
    batch = left_pad([h + t for h, t in zip(heads, tails)], tokenizer.pad_token_id)
    return batch, [len(h) for h in heads], [len(t) for t in tails]


def _response_log_probs(model, batch: dict[str, torch.Tensor], response_lengths: list[int]) -> list[torch.Tensor]:
    """Per row, the teacher-forced log-probabilities of its response tokens ``[T_i]``."""
    logits = model(batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=batch["position_ids"],
                   use_cache=False).logits
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    width = batch["input_ids"].shape[1]
    rows = []
    for i, length in enumerate(response_lengths):
        targets = batch["input_ids"][i, width - length:]
        rows.append(log_probs[i, width - length - 1:width - 1].gather(-1, targets[:, None])[:, 0])
    return rows


def _hook(model, edit):
    """Register ``edit(hidden [B, S, d]) -> hidden`` on the output of decoder layer ``LAYER``."""
    def hook(module, args, output):
        hidden = output[0] if isinstance(output, tuple) else output
        hidden = edit(hidden)
        return (hidden, *output[1:]) if isinstance(output, tuple) else hidden

    return model.model.layers[LAYER].register_forward_hook(hook)


def _loreft_by_hand(model, tokenizer, initial: list[dict[str, torch.Tensor]], lr: float,
                    weight_decay: float) -> tuple[list[float], list[dict[str, torch.Tensor]]]:
    """LoReFT f1+l2 untied, rank 2 (a first-position and a last-positions edit h + Rᵀ(W h + b − R h), R with
    orthonormal rows by torch's parametrization), continuation NLL over the batch's response tokens, AdamW (no decay
    on R's parametrization), the records in file order, ``BATCH`` per step."""
    width = model.config.hidden_size
    parts = []
    for state in initial:
        rotation = nn.utils.parametrizations.orthogonal(nn.Linear(width, 2, bias=False))
        rotation.load_state_dict({k.removeprefix("rotation."): v for k, v in state.items() if k.startswith("rotation.")})
        projection = nn.Linear(width, 2)
        projection.load_state_dict({k.removeprefix("projection."): v for k, v in state.items()
                                    if k.startswith("projection.")})
        parts.append((rotation, projection))
    decayed = [p for _, projection in parts for p in projection.parameters()]
    orthogonal = [p for rotation, _ in parts for p in rotation.parameters()]
    optimizer = torch.optim.AdamW([{"params": decayed, "weight_decay": weight_decay},
                                   {"params": orthogonal, "weight_decay": 0.0}], lr=lr)
    columns: list[tuple[list[int], list[int]]] = []  # per part: (rows, columns) of the current batch

    def edit(hidden: torch.Tensor) -> torch.Tensor:
        for (rotation, projection), (rows, cols) in zip(parts, columns):
            h = hidden[rows, cols]
            r = rotation.weight
            hidden = hidden.index_put((torch.tensor(rows), torch.tensor(cols)),
                                      h + (projection(h) - h @ r.T) @ r)
        return hidden

    losses = []
    handle = _hook(model, edit)
    try:
        for step in range(STEPS):
            start = (step * BATCH) % len(CONTINUATIONS)
            records = CONTINUATIONS[start:start + BATCH]
            batch, prompt_lengths, response_lengths = _batch(tokenizer, [r["prompt"] for r in records],
                                                             [r["response"] for r in records])
            pad = batch["input_ids"].shape[1]
            offsets = [pad - p - t for p, t in zip(prompt_lengths, response_lengths)]
            first = ([i for i in range(BATCH)], [offsets[i] for i in range(BATCH)])
            last = ([i for i in range(BATCH) for _ in range(2)],
                    [offsets[i] + prompt_lengths[i] - k for i in range(BATCH) for k in (2, 1)])
            columns[:] = [first, last]
            rows = _response_log_probs(model, batch, response_lengths)
            loss = -torch.cat(rows).sum() / sum(response_lengths)
            losses.append(float(loss.detach()))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    finally:
        handle.remove()
    final = [{**{f"rotation.{k}": v.detach() for k, v in rotation.state_dict().items()},
              **{f"projection.{k}": v.detach() for k, v in projection.state_dict().items()}}
             for rotation, projection in parts]
    return losses, final


def _patch_states(module: ReFTModule) -> list[dict[str, torch.Tensor]]:
    return [{k: v.detach().clone() for k, v in patch.state_dict().items()}
            for patch in module.intervention.patch_map()[NODE]]


def test_loreft_continuation_nll_trains_as_the_hand_written_loop(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model, tokenizer = tiny_backbone()
    lr, weight_decay = 0.05, 0.1
    module = ReFTModule.from_model(model, tokenizer, lr=lr, weight_decay=weight_decay, interventions=[
        {"node": NODE, "kind": "loreft", "rank": 2, "positions": "f1+l2", "tied": False}])
    assert isinstance(module, PatchTrainingModule)
    initial = _patch_states(module)
    assert len(initial) == 2 and all("rotation.parametrizations.weight.original" in s for s in initial)
    expected_losses, expected_states = _loreft_by_hand(model, tokenizer, initial, lr, weight_decay)
    data = ContinuationDataModule(_write(tmp_path / "train.jsonl", CONTINUATIONS), batch_size=BATCH, shuffle=False)
    recorder = _fit(module, data, STEPS)
    assert len(recorder.losses) == STEPS and expected_losses[-1] < expected_losses[0] - 0.1  # it trains
    torch.testing.assert_close(torch.tensor(recorder.losses), torch.tensor(expected_losses), atol=1e-6, rtol=0)
    for state, expected in zip(_patch_states(module), expected_states):
        assert set(state) == set(expected)
        for name, value in expected.items():
            torch.testing.assert_close(state[name], value, atol=1e-6, rtol=0, msg=name)
    weights = {name: p for name, p in tiny_backbone()[0].named_parameters()}
    for name, p in model.named_parameters():
        assert torch.equal(p, weights[name]), name  # the model stayed frozen


def _bipo_by_hand(model, tokenizer, directions: list[float], lr: float, beta: float,
                  weight_decay: float) -> tuple[list[float], torch.Tensor]:
    """BiPO (Cao et al. 2024, eq. 4) on a vector v added at every token of layer ``LAYER``'s output: per step the
    direction d given, L = −mean log σ(d·β·[(log π_{dv}(chosen) − log π(chosen)) − (log π_{dv}(rejected) −
    log π(rejected))]), sequences' log-probabilities summed over their response tokens; AdamW."""
    vector = torch.zeros(model.config.hidden_size, requires_grad=True)
    optimizer = torch.optim.AdamW([vector], lr=lr, weight_decay=weight_decay)
    sign = [0.0]
    losses = []
    handle = _hook(model, lambda hidden: hidden + sign[0] * vector)
    try:
        for step, direction in enumerate(directions):
            start = (step * BATCH) % len(PREFERENCES)
            records = PREFERENCES[start:start + BATCH]
            prompts = [r["prompt"] for r in records]
            sides = [_batch(tokenizer, prompts, [r[key] for r in records]) for key in ("chosen", "rejected")]
            sign[0] = 0.0
            with torch.no_grad():
                reference = [torch.stack([row.sum() for row in _response_log_probs(model, b, lengths)])
                             for b, _, lengths in sides]
            sign[0] = direction
            steered = [torch.stack([row.sum() for row in _response_log_probs(model, b, lengths)])
                       for b, _, lengths in sides]
            margin = direction * beta * ((steered[0] - reference[0]) - (steered[1] - reference[1]))
            loss = -nn.functional.logsigmoid(margin).mean()
            losses.append(float(loss.detach()))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    finally:
        handle.remove()
    return losses, vector.detach()


def test_bipo_steering_vector_trains_as_the_hand_written_loop(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(1)
    model, tokenizer = tiny_backbone()
    lr, beta, weight_decay = 0.05, 0.5, 0.05
    module = ReFTModule.from_model(model, tokenizer, lr=lr, weight_decay=weight_decay, objective=BiPOObjective(beta),
                                   interventions=[{"node": NODE, "kind": "steer"}])
    assert isinstance(module, PatchTrainingModule)
    data = PreferenceDataModule(_write(tmp_path / "train.jsonl", PREFERENCES), batch_size=BATCH, shuffle=False)
    recorder = _fit(module, data, STEPS)
    # d is drawn from torch's generator in the module; the loop by hand replays the drawn sequence
    assert len(recorder.directions) == STEPS and set(recorder.directions) == {-1.0, 1.0}
    expected_losses, expected_vector = _bipo_by_hand(model, tokenizer, recorder.directions, lr, beta, weight_decay)
    torch.testing.assert_close(torch.tensor(recorder.losses), torch.tensor(expected_losses), atol=1e-6, rtol=0)
    (patch,) = module.intervention.patch_map()[NODE]
    assert float(expected_vector.norm()) > 0.05  # it trains
    torch.testing.assert_close(patch.value.detach(), expected_vector, atol=1e-6, rtol=0)


def test_reft_is_a_sibling_of_interchange_without_its_methods() -> None:
    """ReFT patches read no source: ReFTModule is the interchange module's sibling, not its subclass, and has no
    interchange methods to refuse (it used to inherit them and raise)."""
    module = ReFTModule.from_model(*tiny_backbone(), interventions=[{"node": NODE, "kind": "loreft", "rank": 2,
                                                                     "positions": "f1+l1"}])
    assert isinstance(module, PatchTrainingModule) and not isinstance(module, InterventionModule)
    assert not any(hasattr(module, name) for name in ("iia", "interchange_log_probs"))
