"""DeltaModule, InterventionModule's additive special case: trained under Lightning against the same training written
by hand in this test (the model's own forward with a hook adding the delta, the objective's terms summed here, Adam
and the max_norm clamp), and what it inherits (tiny random Llama)."""

from __future__ import annotations

import torch
from lightning.pytorch import Callback, Trainer

from recipes import DeltaModule, DeltaSpec, InterventionModule, Objective, PatchTrainingModule, TargetSpec
from recipes.delta.objectives import KIND_KL, KIND_STEER, KIND_TARGET
from recipes.delta.rows import build_rows, collate_rows
from recipes.tokens import left_pad, single_token_ids
from recipes.delta.objectives import away_loss, kl_loss, target_nll, towards_loss
from recipes.testing import tiny_backbone

OBJECTIVE = Objective(targets=[TargetSpec("The Eiffel Tower is located in the city of", " Rome")],
                      steer_prompts=["I feel"], towards=["happy"], away=["sad"],
                      kl_prompts=["the dog", "my friend is"], kl_weight=0.1, l2_weight=0.01, away_weight=0.5)
LR, MAX_NORM, STEPS = 0.1, 0.5, 6


class _Losses(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["terms"]["loss"]))


def _last_log_probs(model, tokenizer, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    logits = model(batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=batch["position_ids"],
                   use_cache=False).logits
    return torch.log_softmax(logits[:, -1].float(), dim=-1)


def _by_hand(model, tokenizer) -> tuple[list[float], torch.Tensor]:
    """Losses before each step and the final delta of the training DeltaModule does, without recipes' modules."""
    pad_id = tokenizer.pad_token_id
    rows = build_rows(tokenizer, OBJECTIVE)
    batch = collate_rows(rows, pad_id)
    towards = torch.tensor(single_token_ids(tokenizer, OBJECTIVE.towards))
    away = torch.tensor(single_token_ids(tokenizer, OBJECTIVE.away))
    with torch.no_grad():
        kl_batch = left_pad([list(row.ids) for row in rows if row.kind == KIND_KL], pad_id)
        reference = _last_log_probs(model, tokenizer, kl_batch)
    delta = torch.zeros(model.config.hidden_size, requires_grad=True)

    def add_delta(module, args, output):
        hidden = output[0] if isinstance(output, tuple) else output
        hidden = torch.cat([hidden[:, :-1], hidden[:, -1:] + delta], dim=1)
        return (hidden, *output[1:]) if isinstance(output, tuple) else hidden

    optimizer = torch.optim.Adam([delta], lr=LR)
    losses = []
    handle = model.model.layers[1].register_forward_hook(add_delta)
    try:
        for _ in range(STEPS):
            log_probs = _last_log_probs(model, tokenizer, batch)
            kind = batch["kind"]
            target, steer, kl = kind == KIND_TARGET, kind == KIND_STEER, kind == KIND_KL
            loss = OBJECTIVE.nll_weight * target_nll(log_probs[target], batch["target"][target],
                                                     batch["weight"][target])[0]
            loss = loss + OBJECTIVE.towards_weight * towards_loss(log_probs[steer], towards)[0]
            loss = loss + OBJECTIVE.away_weight * away_loss(log_probs[steer], away)[0]
            loss = loss + OBJECTIVE.kl_weight * kl_loss(reference[batch["kl_index"][kl]], log_probs[kl])
            loss = loss + OBJECTIVE.l2_weight * delta.pow(2).sum()
            losses.append(float(loss.detach()))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            with torch.no_grad():
                norm = delta.norm()
                if norm > MAX_NORM:
                    delta.mul_(MAX_NORM / norm)
    finally:
        handle.remove()
    return losses, delta.detach()


def test_delta_module_trains_as_the_hand_written_loop():
    torch.set_num_threads(1)
    model, tokenizer = tiny_backbone()
    expected_losses, expected_delta = _by_hand(model, tokenizer)
    module = DeltaModule.from_model(model, tokenizer, deltas=[DeltaSpec("model.layers_1.output", "last")],
                                    objective=OBJECTIVE, lr=LR, max_norm=MAX_NORM)
    recorder = _Losses()
    Trainer(max_steps=STEPS, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, callbacks=[recorder]).fit(module)
    assert len(recorder.losses) == STEPS
    assert expected_losses[-1] < expected_losses[0]  # the run trains: the comparison is not of a flat curve
    torch.testing.assert_close(torch.tensor(recorder.losses), torch.tensor(expected_losses), atol=1e-6, rtol=0)
    torch.testing.assert_close(module.deltas[0].detach(), expected_delta, atol=1e-6, rtol=0)
    assert float(module.deltas[0].detach().norm()) <= MAX_NORM + 1e-6


def test_delta_module_is_the_additive_patch_training_module_and_loads_its_export(tmp_path):
    torch.set_num_threads(1)
    config = dict(deltas=[DeltaSpec("model.layers_1.output", "last"), DeltaSpec("model.layers_0.output", -2)],
                  objective=OBJECTIVE)
    module = DeltaModule.from_model(*tiny_backbone(), **config)
    assert isinstance(module, PatchTrainingModule) and module.patches == module.delta_patches
    with torch.no_grad():
        for i, delta in enumerate(module.deltas):
            delta.copy_(torch.randn(delta.shape, generator=torch.Generator().manual_seed(i)))
    module.export_intervention(tmp_path / "deltas")
    fresh = DeltaModule.from_model(*tiny_backbone(), **config)
    assert all(float(delta.detach().abs().max()) == 0 for delta in fresh.deltas)
    fresh.load_intervention(tmp_path / "deltas")
    for loaded, saved in zip(fresh.deltas, module.deltas):
        torch.testing.assert_close(loaded.detach(), saved.detach(), atol=0, rtol=0)


def test_deltas_are_a_sibling_of_interchange_without_its_methods():
    """Deltas read no source: DeltaModule is the interchange module's sibling, not its subclass, and has no
    interchange methods to refuse (it used to inherit them and raise)."""
    module = DeltaModule.from_model(*tiny_backbone(), deltas=[DeltaSpec("model.layers_1.output")], objective=OBJECTIVE)
    assert not isinstance(module, InterventionModule)
    assert not any(hasattr(module, name) for name in ("iia", "evaluate", "interchange_log_probs"))
