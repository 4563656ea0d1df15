"""DeltaModule: rows and objectives, frozen model, optimizer, training, export and checkpoints (tiny random Llama)."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback, Trainer

from gradpatch import Intervention, PatchableGraph
from recipes import DeltaModule, DeltaSpec, Objective, RecipeConfigError, TargetSpec
from recipes.delta.objectives import KIND_KL, KIND_STEER, KIND_TARGET
from recipes.delta.rows import Row, build_rows, collate_rows
from recipes.tokens import left_pad
from recipes.delta.objectives import away_loss, kl_loss, target_nll, towards_loss
from recipes.delta.specs import position_slice
from recipes.testing import tiny_backbone

PROMPT = "The Eiffel Tower is located in the city of"


@pytest.fixture
def backbone():
    torch.set_num_threads(1)
    return tiny_backbone()


def make_module(backbone, **overrides) -> DeltaModule:
    config = dict(
        deltas=[DeltaSpec("model.layers_1.output", "last")],
        objective=Objective(targets=[TargetSpec(PROMPT, " Rome")], kl_prompts=["the dog", "my friend is"],
                            kl_weight=0.1, l2_weight=0.01),
        lr=0.1,
    )
    config.update(overrides)
    return DeltaModule.from_model(*backbone, **config)


def quiet_trainer(max_steps: int, **kwargs) -> Trainer:
    options = dict(max_steps=max_steps, accelerator="cpu", logger=False, enable_checkpointing=False,
                   enable_progress_bar=False, enable_model_summary=False)
    options.update(kwargs)
    return Trainer(**options)


# --- rows and objectives ---------------------------------------------------------------------------------------


def test_rows_expand_targets_token_by_token(backbone):
    _, tokenizer = backbone
    objective = Objective(targets=[TargetSpec("the capital of France is", "Paris Rome")], steer_prompts=["I feel"],
                          towards=["happy"], kl_prompts=["the dog"])
    rows = build_rows(tokenizer, objective)
    prompt = tokenizer("the capital of France is")["input_ids"]
    paris, rome = tokenizer("Paris")["input_ids"][0], tokenizer("Rome")["input_ids"][0]
    assert [row.kind for row in rows] == [KIND_TARGET, KIND_TARGET, KIND_STEER, KIND_KL]
    assert rows[0].ids == tuple(prompt) and rows[0].target == paris and rows[0].weight == 0.5
    assert rows[1].ids == tuple(prompt + [paris]) and rows[1].target == rome
    assert rows[3].kl_index == 0


def test_left_padding_puts_every_last_token_at_minus_one():
    batch = left_pad([[5, 6, 7], [8]], pad_id=0)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [0, 0, 8]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [0, 0, 1]]
    assert batch["position_ids"].tolist() == [[0, 1, 2], [0, 0, 0]]


def test_padded_rows_score_like_unpadded_ones(backbone):
    module = make_module(backbone)
    short, long = (5, 6), (7, 8, 9, 10, 11)
    alone = module.logits(collate_rows([Row(short, KIND_TARGET)], module.pad_id))
    together = module.logits(collate_rows([Row(long, KIND_TARGET), Row(short, KIND_TARGET)], module.pad_id))
    torch.testing.assert_close(together[1, -1], alone[0, -1], atol=1e-5, rtol=1e-5)


def test_objective_terms_by_hand():
    log_probs = torch.log_softmax(torch.tensor([[2.0, 0.0, -1.0], [0.0, 1.0, 0.0]]), dim=-1)
    probs = log_probs.exp()
    nll, p = target_nll(log_probs, torch.tensor([0, 1]), torch.tensor([1.0, 1.0]))
    assert nll.item() == pytest.approx(-(log_probs[0, 0] + log_probs[1, 1]).item() / 2)
    assert p.item() == pytest.approx((probs[0, 0] + probs[1, 1]).item() / 2)
    towards, p_set = towards_loss(log_probs, torch.tensor([1, 2]))
    expected = -torch.log(probs[:, 1] + probs[:, 2]).mean()
    assert towards.item() == pytest.approx(expected.item(), rel=1e-6)
    away, _ = away_loss(log_probs, torch.tensor([1, 2]))
    assert away.item() == pytest.approx(-torch.log(probs[:, 0]).mean().item(), rel=1e-5)
    assert p_set.item() == pytest.approx((probs[:, 1] + probs[:, 2]).mean().item(), rel=1e-6)
    assert kl_loss(log_probs, log_probs).item() == pytest.approx(0.0, abs=1e-7)
    assert kl_loss(log_probs, log_probs.flip(0)).item() > 0


def test_configuration_errors_name_the_fix(backbone):
    with pytest.raises(RecipeConfigError, match="no terms"):
        make_module(backbone, objective=Objective(kl_prompts=["the dog"]))
    with pytest.raises(RecipeConfigError, match="steer_prompts"):
        make_module(backbone, objective=Objective(towards=["happy"]))
    with pytest.raises(RecipeConfigError, match="count from the end"):
        position_slice(3)
    with pytest.raises(RecipeConfigError, match=r"\[batch, seq, \.\.\.\]"):
        make_module(backbone, deltas=[DeltaSpec("model.layers_1.self_attn.q_proj.weight", "all")])
    with pytest.raises(KeyError, match="layers_9"):
        make_module(backbone, deltas=[DeltaSpec("model.layers_9.output", "last")])


def test_multi_token_steering_word_is_rejected():
    from recipes.tokens import single_token_ids

    class TwoTokens:
        def __call__(self, text, add_special_tokens=True):
            return {"input_ids": [1, 2]}

        def decode(self, ids):
            return str(ids)

    with pytest.raises(RecipeConfigError, match="single-token"):
        single_token_ids(TwoTokens(), [" Londonderry"])


# --- the frozen model ------------------------------------------------------------------------------------------


def test_only_the_deltas_are_trainable(backbone):
    module = make_module(backbone, deltas=[DeltaSpec("model.layers_0.output", "all"),
                                           DeltaSpec("model.layers_1.mlp.down_proj.output", -2)])
    optimizer = module.configure_optimizers()
    optimized = [p for group in optimizer.param_groups for p in group["params"]]
    assert [tuple(p.shape) for p in optimized] == [(64,), (64,)]
    assert all(any(p is d for d in module.deltas) for p in optimized)
    assert not any(p.requires_grad for p in module.graph.parameters())
    assert [name for name, _ in module.named_parameters() if not name.startswith("pg.")] == [
        "intervention.values.0", "intervention.values.1"]
    assert module.delta_patches[1].slice == (slice(None), -2)


class ModeSpy(Callback):
    """Records the training flags seen during each training step."""

    def __init__(self) -> None:
        self.seen: list[tuple[bool, bool, bool]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.seen.append((pl_module.training, pl_module.graph.training,
                          any(m.training for m in pl_module.model.modules())))


def test_fit_keeps_the_model_frozen_and_in_eval_and_lowers_the_loss(backbone):
    module = make_module(backbone)
    weights_before = {n: p.detach().clone() for n, p in module.model.named_parameters()}
    batch = collate_rows(module.rows, module.pad_id)
    with torch.no_grad():
        before = module.loss_terms(batch)
    spy = ModeSpy()
    quiet_trainer(15, callbacks=[spy]).fit(module)
    with torch.no_grad():
        after = module.loss_terms(batch)
    assert spy.seen == [(True, False, False)] * 15  # LightningModule training; graph and model in eval
    assert after["nll"] < before["nll"] - 0.5
    assert after["p_target"] > 3 * before["p_target"]
    assert module.deltas[0].abs().sum() > 0
    for name, parameter in module.model.named_parameters():
        assert torch.equal(parameter, weights_before[name]), name
        assert parameter.grad is None


@pytest.mark.parametrize("direction", ["towards", "away"])
def test_steering_objective_moves_probabilities(backbone, direction):
    words = {"towards": ["happy", "great"], "away": ["sad", "bad"]}
    objective = Objective(steer_prompts=["I feel", "today was"], l2_weight=0.001, **{direction: words[direction]})
    module = make_module(backbone, deltas=[DeltaSpec("model.layers_0.output", "all")], objective=objective)
    batch = collate_rows(module.rows, module.pad_id)
    with torch.no_grad():
        before = module.loss_terms(batch)
    quiet_trainer(20).fit(module)
    with torch.no_grad():
        after = module.loss_terms(batch)
    if direction == "towards":
        assert after["p_towards"] > 2 * before["p_towards"]
    else:
        assert after["p_away"] < 0.5 * before["p_away"]
    assert set(after) == {direction, f"p_{direction}", "l2", "loss", "norm/0"}


def test_kl_term_is_zero_for_a_zero_delta_and_restrains_the_delta(backbone):
    module = make_module(backbone)
    batch = collate_rows(module.rows, module.pad_id)
    with torch.no_grad():
        assert module.loss_terms(batch)["kl"].abs().item() < 1e-6
    free = make_module(backbone, objective=Objective(targets=[TargetSpec(PROMPT, " Rome")],
                                                     kl_prompts=["the dog", "my friend is"], kl_weight=0.0))
    held = make_module(backbone, objective=Objective(targets=[TargetSpec(PROMPT, " Rome")],
                                                     kl_prompts=["the dog", "my friend is"], kl_weight=20.0))
    quiet_trainer(10).fit(free)
    quiet_trainer(10).fit(held)
    with torch.no_grad():
        assert held.loss_terms(batch)["kl"] < free.loss_terms(batch)["kl"]


def test_max_norm_clamps_each_delta(backbone):
    module = make_module(backbone, max_norm=0.3, lr=0.5)
    quiet_trainer(5).fit(module)
    assert module.deltas[0].norm().item() == pytest.approx(0.3, rel=1e-5)


# --- export and checkpoints ------------------------------------------------------------------------------------


def test_exported_intervention_gives_the_same_outputs_in_a_fresh_graph(backbone, tmp_path):
    module = make_module(backbone)
    quiet_trainer(5).fit(module)
    batch = collate_rows(module.rows, module.pad_id)
    with torch.no_grad(), module.graph.patch(module.intervention):
        expected = module.logits(batch)
    folder = module.export_intervention(tmp_path / "eiffel")
    assert sorted(p.name for p in folder.iterdir()) == ["intervention.json", "intervention.safetensors"]

    model, _ = backbone
    ids = batch["input_ids"]
    fresh = PatchableGraph(model, ids, attention_mask=batch["attention_mask"], position_ids=batch["position_ids"],
                           use_cache=False)
    loaded = Intervention.load(folder, graph=fresh, model=model)
    with torch.no_grad(), fresh.patch(loaded):
        logits = fresh(ids, attention_mask=batch["attention_mask"], position_ids=batch["position_ids"],
                       use_cache=False).logits
    torch.testing.assert_close(logits[:, -1], expected[:, -1])
    with torch.no_grad():
        unpatched = fresh(ids, attention_mask=batch["attention_mask"], position_ids=batch["position_ids"],
                          use_cache=False).logits
    assert not torch.allclose(unpatched[:, -1], expected[:, -1])


def test_checkpoint_holds_only_the_intervention_and_loads_back(backbone, tmp_path):
    module = make_module(backbone)
    trainer = quiet_trainer(4, enable_checkpointing=True, default_root_dir=tmp_path)
    trainer.fit(module)
    path = Path(trainer.checkpoint_callback.best_model_path)  # written by Lightning's ModelCheckpoint
    assert path.is_file() and path.parent == tmp_path / "checkpoints"
    checkpoint = torch.load(path, weights_only=True)
    assert list(checkpoint["state_dict"]) == ["intervention.values.0"]
    model_bytes = sum(p.numel() * p.element_size() for p in module.model.parameters())
    assert path.stat().st_size < 100_000 < model_bytes
    assert checkpoint["hyper_parameters"]["deltas"] == [{"node": "model.layers_1.output", "position": "last"}]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        restored = DeltaModule.load_from_checkpoint(path, _backbone=tiny_backbone())
    torch.testing.assert_close(restored.deltas[0], module.deltas[0])
    assert restored.objective == module.objective and restored.lr == module.lr


def test_checkpoint_of_other_deltas_is_refused(backbone, tmp_path):
    module = make_module(backbone)
    trainer = quiet_trainer(1, default_root_dir=tmp_path)
    trainer.fit(module)
    trainer.save_checkpoint(tmp_path / "one.ckpt")
    two = [DeltaSpec("model.layers_1.output", "last"), DeltaSpec("model.layers_0.output", "all")]
    with pytest.raises(RecipeConfigError, match="intervention.values.1"):
        DeltaModule.load_from_checkpoint(tmp_path / "one.ckpt", _backbone=tiny_backbone(), deltas=two)


def test_generate_applies_the_intervention(backbone):
    module = make_module(backbone)
    quiet_trainer(25).fit(module)
    rome = module.tokenizer.decode(module.tokenizer("Rome")["input_ids"])
    assert module.generate([PROMPT], max_new_tokens=1)[0].strip() == rome
    assert module.generate([PROMPT], max_new_tokens=1, patched=False)[0].strip() != rome


def test_greedy_generate_is_one_loop_for_graphs_and_models(backbone):
    """The one greedy loop: a plain model and its graph give the same text, batched (left-padded) or one at a time."""
    from recipes.generation import greedy_generate

    model, tokenizer = backbone
    prompts = ["the city of", "The Eiffel Tower is located in the city of", "my friend is"]
    pg = PatchableGraph(model, tokenizer(prompts[0], return_tensors="pt").input_ids, use_cache=False)
    plain = greedy_generate(model, tokenizer, prompts, max_new_tokens=5, batch_size=1)
    assert plain == greedy_generate(pg, tokenizer, prompts, max_new_tokens=5, batch_size=1)
    assert plain == greedy_generate(pg, tokenizer, prompts, max_new_tokens=5)
    assert all(text.strip() for text in plain)
    with pytest.raises(ValueError, match="batch_size"):
        greedy_generate(pg, tokenizer, prompts, batch_size=0)


def test_compiled_training_takes_the_steps_of_eager_training(backbone):
    """``compile`` runs the frozen graph through torch.compile (here ``aot_eager``: AOTAutograd's forward and
    backward graphs, without inductor's kernels): the same deltas as eager training after the same steps."""
    torch.compiler.reset()
    eager, compiled = make_module(backbone), make_module(backbone, compile={"backend": "aot_eager"})
    assert compiled.hparams["compile"] == {"backend": "aot_eager"}
    for module in (eager, compiled):
        quiet_trainer(6).fit(module)
    assert compiled.graph._compiled.patch_sets >= 1 and eager.graph._compiled is None  # the compiled module compiled
    assert eager.deltas[0].abs().sum() > 0
    torch.testing.assert_close(compiled.deltas[0], eager.deltas[0], rtol=1e-4, atol=1e-6)
    torch.compiler.reset()
