"""InterventionModule, CounterfactualDataModule and `gradpatch fit` with a das config, on the tiny Llama."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer

from gradpatch.errors import InterventionLoadError, SubspaceConfigError
from recipes import CounterfactualDataModule, InterventionModule, RecipeConfigError, cli
from recipes.interchange.counterfactual import CounterfactualRecord, read_counterfactuals
from recipes.testing import save_tiny_backbone, tiny_backbone

CONFIG = Path(__file__).resolve().parents[2] / "recipes" / "configs" / "das_country.yaml"
COUNTRIES = {"Paris": "France", "Rome": "Italy", "Berlin": "Germany", "Madrid": "Spain"}


def _records(**extra: object) -> list[dict]:
    return [{"base": f"the city {a} is in the country", "source": f"a big city {b} is in", "label": COUNTRIES[b],
             "base_subject": a, "source_subject": b, **extra}
            for a in COUNTRIES for b in COUNTRIES if a != b]


def _write(path: Path, records: list[dict]) -> str:
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return str(path)


def _trainer(steps: int) -> Trainer:
    return Trainer(max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                   enable_model_summary=False, num_sanity_val_steps=0)


@pytest.mark.parametrize("kind", ["rotated", "boundless", "mask"])
def test_training_moves_only_the_patches_and_keeps_r_orthonormal(tmp_path: Path, kind: str) -> None:
    model, tokenizer = tiny_backbone()
    weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    module = InterventionModule.from_model(model, tokenizer, lr=0.05, interventions=[
        {"node": "model.layers_0.output", "kind": kind, "dim": 4, "init": -1.0}])
    before = {name: p.detach().clone() for name, p in module.named_parameters() if not name.startswith("pg.")}
    data = CounterfactualDataModule(_write(tmp_path / "train.jsonl", _records()), batch_size=6)
    _trainer(3).fit(module, datamodule=data)
    for name, p in model.named_parameters():
        assert torch.equal(p, weights[name]), name
    after = dict(module.named_parameters())
    assert any((after[name] - value).abs().max() > 0 for name, value in before.items())
    patch = module.patches[0]
    if kind != "mask":
        rotation = patch.R.detach()
        assert float((rotation @ rotation.T - torch.eye(rotation.shape[0])).abs().max()) <= 1e-5
    assert module.temperature() == pytest.approx(0.1)  # annealed to temperature_end at the last step
    metrics = module.write_metrics(tmp_path, data.train_records)
    assert set(metrics) >= {"iia", "full_interchange_iia", "node", "dim", "examples"}
    assert json.loads((tmp_path / "metrics.json").read_text()) == metrics


@pytest.mark.parametrize("shared_batch,expected", [(None, False), (True, True), (False, False)])
def test_the_layout_is_two_passes_on_the_cpu_unless_asked_and_gives_the_same_log_probs(
        monkeypatch: pytest.MonkeyPatch, shared_batch: bool | None, expected: bool) -> None:
    import recipes.interchange.module as module_file

    model, tokenizer = tiny_backbone()
    module = InterventionModule.from_model(model, tokenizer, shared_batch=shared_batch, interventions=[
        {"node": "model.layers_0.output", "kind": "rotated", "dim": 4}])
    encoded = module.encode([CounterfactualRecord(**record) for record in _records()[:3]])
    layouts: list[bool] = []
    original = module_file.interchange

    def spy(*args: object, shared_batch: bool, **kwargs: object) -> object:
        layouts.append(shared_batch)
        return original(*args, shared_batch=shared_batch, **kwargs)

    monkeypatch.setattr(module_file, "interchange", spy)
    with torch.no_grad():
        log_probs = module.interchange_log_probs(encoded)
        module.shared_batch = not expected  # the other layout: the same numbers
        other = module.interchange_log_probs(encoded)
    assert layouts == [expected, not expected]
    torch.testing.assert_close(log_probs, other, atol=1e-5, rtol=1e-5)


def test_adamw_never_decays_the_orthogonal_rotation(tmp_path: Path) -> None:
    """AdamW's weight decay on torch's orthogonal parametrization of a non-square R zeroes it; the optimizer puts
    the parametrized tensors in a group without decay, so R stays orthonormal (and non-zero) under AdamW."""
    model, tokenizer = tiny_backbone()
    module = InterventionModule.from_model(model, tokenizer, lr=0.05, optimizer="adamw", interventions=[
        {"node": "model.layers_0.output", "kind": "rotated", "dim": 4}])
    groups = module.configure_optimizers().param_groups
    decayed = {id(p) for group in groups if group["weight_decay"] > 0 for p in group["params"]}
    parametrized = [p for name, p in module.named_trainable().items() if ".parametrizations." in name]
    assert parametrized and not any(id(p) in decayed for p in parametrized)
    data = CounterfactualDataModule(_write(tmp_path / "train.jsonl", _records()), batch_size=6)
    _trainer(3).fit(module, datamodule=data)
    rotation = module.patches[0].R.detach()
    assert float((rotation @ rotation.T - torch.eye(rotation.shape[0])).abs().max()) <= 1e-5


def test_bad_records_fail_before_the_first_step(tmp_path: Path) -> None:
    model, tokenizer = tiny_backbone()

    def fit(records: list[dict], **config: object) -> None:
        module = InterventionModule.from_model(model, tokenizer, interventions=[
            {"node": "model.layers_0.output", "dim": 2}], **config)
        _trainer(1).fit(module, datamodule=CounterfactualDataModule(_write(tmp_path / "r.jsonl", records)))

    with pytest.raises(RecipeConfigError, match="one token"):
        fit([{**_records()[0], "label": "France Italy"}])
    with pytest.raises(SubspaceConfigError, match="not in prompt"):
        fit([{**_records()[0], "base_subject": "London"}])
    no_positions = [{"base": "the city Paris is in", "source": "a city", "label": "Italy"}]
    with pytest.raises(SubspaceConfigError, match="without positions"):
        fit(no_positions, position=None)
    with pytest.raises(SubspaceConfigError, match="dim=65"):
        InterventionModule.from_model(model, tokenizer, interventions=[{"node": "model.layers_0.output", "dim": 65}])
    with pytest.raises(SubspaceConfigError, match=r"not \[batch, seq, d\]"):
        InterventionModule.from_model(model, tokenizer, interventions=[
            {"node": "model.layers_0.self_attn.query_states", "dim": 2}])
    (tmp_path / "bad.jsonl").write_text('{"base": "a", "label": "b"}\n')
    with pytest.raises(RecipeConfigError, match="missing"):
        read_counterfactuals(tmp_path / "bad.jsonl")


def test_gradpatch_fit_with_the_das_config(tmp_path: Path) -> None:
    model_dir = save_tiny_backbone(tmp_path / "model")
    root = tmp_path / "run"
    status = cli.main(["fit", "--config", str(CONFIG), "--model.model_path", str(model_dir),
                       "--model.interventions", '[{"node": "model.layers_1.output", "kind": "rotated", "dim": 4}]',
                       "--data.train_file", _write(tmp_path / "train.jsonl", _records()),
                       "--data.eval_file", _write(tmp_path / "eval.jsonl", _records()[:5]),
                       "--data.batch_size", "4", "--trainer.max_steps", "4", "--trainer.val_check_interval", "2",
                       "--trainer.log_every_n_steps", "1",
                       "--trainer.default_root_dir", str(root)])
    assert status == 0
    metrics = json.loads((root / "metrics.json").read_text())
    assert metrics["node"] == "model.layers_1.output" and metrics["dim"] == 4 and metrics["examples"] == 5
    assert 0.0 <= metrics["iia"] <= 1.0 and metrics["steps"] == 4
    events = list(root.rglob("events.out.tfevents.*"))
    assert events, "TensorBoard events"
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tags = EventAccumulator(str(events[0].parent)).Reload().Tags()["scalars"]
    assert {"train/loss", "train/ce", "iia"} <= set(tags)
    model, tokenizer = tiny_backbone()
    module = InterventionModule.from_model(model, tokenizer, interventions=[
        {"node": "model.layers_1.output", "kind": "rotated", "dim": 4}])
    module.load_intervention(root / "intervention")
    other = InterventionModule.from_model(model, tokenizer, interventions=[
        {"node": "model.layers_1.output", "kind": "rotated", "dim": 8}])
    with pytest.raises(InterventionLoadError, match="expects"):
        other.load_intervention(root / "intervention")
