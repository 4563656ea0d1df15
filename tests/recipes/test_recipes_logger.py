"""InterventionLogger writes scalars, histograms, text and hparams that TensorBoard reads back."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.hparams import plugin_data_pb2

from recipes import DeltaModule, DeltaSpec, InterventionLogger, Objective, RecipeConfigError, TargetSpec
from recipes.testing import tiny_backbone

PROMPT = "The Eiffel Tower is located in the city of"
STEPS = 12


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One logged fit of a target-continuation delta: (event accumulator, module, callback)."""
    torch.set_num_threads(1)
    module = DeltaModule.from_model(
        *tiny_backbone(),
        deltas=[DeltaSpec("model.layers_1.output", "last"), DeltaSpec("model.layers_0.mlp.down_proj.output", "all")],
        objective=Objective(targets=[TargetSpec(PROMPT, " Rome")], kl_prompts=["the dog"], kl_weight=0.1,
                            l2_weight=0.01),
        lr=0.1)
    callback = InterventionLogger(histogram_every_n_steps=5, max_new_tokens=3)
    logger = TensorBoardLogger(tmp_path_factory.mktemp("runs"), name="eiffel")
    Trainer(max_steps=STEPS, accelerator="cpu", logger=logger, callbacks=[callback], enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False).fit(module)
    accumulator = EventAccumulator(logger.log_dir, size_guidance={"scalars": 0, "histograms": 0, "tensors": 0})
    accumulator.Reload()
    return accumulator, module, callback


def test_scalars_every_step(run):
    accumulator, module, _ = run
    tags = set(accumulator.Tags()["scalars"])
    expected = {"loss/total", "loss/nll", "loss/kl", "loss/l2", "prob/target",
                "delta_norm/model.layers_1.output@last", "delta_norm/model.layers_0.mlp.down_proj.output@all"}
    assert expected <= tags
    for tag in expected:
        assert [event.step for event in accumulator.Scalars(tag)] == list(range(STEPS)), tag
    loss = [event.value for event in accumulator.Scalars("loss/total")]
    assert loss[-1] < loss[0]
    nll = [e.value for e in accumulator.Scalars("loss/nll")]
    probability = [e.value for e in accumulator.Scalars("prob/target")]
    assert probability[0] == pytest.approx(float(torch.tensor(-nll[0]).exp()), rel=1e-4)  # one target token
    assert accumulator.Scalars("delta_norm/model.layers_1.output@last")[0].value == 0.0
    # The norm logged at step s is the delta's before that step's update: step 1 sees one Adam step of lr 0.1.
    assert accumulator.Scalars("delta_norm/model.layers_1.output@last")[1].value == pytest.approx(
        0.1 * 64 ** 0.5, rel=1e-3)


def test_histograms_of_each_delta(run):
    accumulator, module, _ = run
    for name, delta in zip(module.delta_names(), module.deltas):
        events = accumulator.Histograms(f"delta/{name}")
        assert [event.step for event in events] == [0, 5, 10, STEPS - 1]
        final = events[-1].histogram_value
        assert final.num == delta.numel()
        assert final.min == pytest.approx(delta.min().item(), rel=1e-5)
        assert final.max == pytest.approx(delta.max().item(), rel=1e-5)


def test_generations_before_and_after_as_text(run):
    accumulator, module, callback = run
    (event,) = accumulator.Tensors("generations/text_summary")
    text = event.tensor_proto.string_val[0].decode()
    assert text.startswith("| prompt | before | after |")
    rows = text.splitlines()[2:]
    assert len(rows) == len(module.generation_prompts()) == 2
    assert PROMPT in rows[0]
    assert callback.before and callback.after
    assert callback.before == module.generate(module.generation_prompts(), 3, patched=False)
    assert callback.after == module.generate(module.generation_prompts(), 3)
    assert f"`{callback.after[0]}`" in rows[0] and f"`{callback.before[0]}`" in rows[0]


def test_hparams(run):
    accumulator, module, _ = run
    content = accumulator.PluginTagToContent("hparams")
    start = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_start_info"]).session_start_info
    hparams = {key: value.string_value or value.number_value for key, value in start.hparams.items()}
    assert hparams["nodes"] == "model.layers_1.output, model.layers_0.mlp.down_proj.output"
    assert hparams["positions"] == "last, all"
    assert hparams["objective"] == "nll + kl + l2"
    assert hparams["lr"] == pytest.approx(0.1)
    assert hparams["max_steps"] == STEPS and hparams["steps"] == STEPS
    experiment = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/experiment"]).experiment
    assert {info.name.tag for info in experiment.metric_infos} == {"hp/loss", "hp/p_target"}
    (final,) = accumulator.Scalars("hp/loss")
    assert final.value == pytest.approx(accumulator.Scalars("loss/total")[-1].value)


def test_needs_a_tensorboard_logger():
    module = DeltaModule.from_model(*tiny_backbone(), deltas=[DeltaSpec("model.layers_1.output")],
                                    objective=Objective(targets=[TargetSpec(PROMPT, " Rome")]))
    trainer = Trainer(max_steps=1, accelerator="cpu", logger=False, callbacks=[InterventionLogger()],
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(RecipeConfigError, match="TensorBoardLogger"):
        trainer.fit(module)
