"""ReFTModule, continuation/preference data, continuation NLL, BiPO, CAA, `gradpatch fit`/`generate`, tiny Llama."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer

from gradpatch.errors import InterventionLoadError, SubspaceConfigError
from recipes import BiPOObjective, ContinuationDataModule, PreferenceDataModule, RecipeConfigError, ReFTModule, cli
from recipes.reft.caa import caa_vector, continuation_mean_activations
from recipes.reft.continuations import PreferenceRecord, read_continuations, read_preferences
from recipes.testing import save_tiny_backbone, tiny_backbone

CONFIGS = Path(__file__).resolve().parents[2] / "recipes" / "configs"
NODE = "model.layers_0.output"
COUNTRIES = {"Paris": "France", "Rome": "Italy", "Berlin": "Germany", "Madrid": "Spain"}


def _write(path: Path, records: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def _continuations() -> list[dict]:
    return [{"prompt": f"the city {city} is in the country", "response": country}
            for city, country in COUNTRIES.items()]


def _preferences() -> list[dict]:
    return [{"prompt": f"I feel the {thing} was very", "chosen": "good happy", "rejected": "bad sad"}
            for thing in ("movie", "food", "music", "weather")]


def _trainer(steps: int) -> Trainer:
    return Trainer(max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                   enable_model_summary=False, num_sanity_val_steps=0)


def test_readers_refuse_empty_responses_and_equal_pairs(tmp_path: Path) -> None:
    assert len(read_continuations(_write(tmp_path / "ok.jsonl", _continuations()))) == 4
    with pytest.raises(RecipeConfigError, match="missing or empty"):
        read_continuations(_write(tmp_path / "empty.jsonl", [{"prompt": "the city", "response": " "}]))
    with pytest.raises(RecipeConfigError, match="chosen equal to rejected"):
        read_preferences(_write(tmp_path / "same.jsonl", [{"prompt": "I feel", "chosen": "good", "rejected": "good"}]))
    with pytest.raises(RecipeConfigError, match="unknown fields"):
        read_preferences(_write(tmp_path / "extra.jsonl", [{**_preferences()[0], "label": "x"}]))


def test_bad_configuration_fails_before_training(tmp_path: Path) -> None:
    model, tokenizer = tiny_backbone()
    with pytest.raises(SubspaceConfigError, match="rank"):
        ReFTModule.from_model(model, tokenizer, interventions=[{"node": NODE, "kind": "loreft", "rank": 64}])
    for kind in ("add", "loreft"):  # BiPO flips the sign of steering vectors only; these would train unsigned
        with pytest.raises(RecipeConfigError, match=rf"BiPO trains steering vectors .*\['{kind}'\]"):
            ReFTModule.from_model(model, tokenizer, objective=BiPOObjective(),
                                  interventions=[{"node": NODE, "kind": kind}])
    module = ReFTModule.from_model(model, tokenizer, interventions=[
        {"node": NODE, "kind": "loreft", "rank": 2, "positions": "f4+l4"}])  # prompts have 6 tokens
    data = ContinuationDataModule(_write(tmp_path / "train.jsonl", _continuations()), batch_size=2)
    before = [p.detach().clone() for p in module.trainable_parameters()]
    with pytest.raises(SubspaceConfigError, match="need 8 prompt tokens"):
        _trainer(2).fit(module, datamodule=data)
    assert all(torch.equal(a, b) for a, b in zip(before, module.trainable_parameters()))


@pytest.mark.parametrize("kind,tied", [("loreft", False), ("direft", True), ("add", True)])
def test_continuation_nll_training_lowers_the_loss_and_leaves_the_model(tmp_path: Path, kind: str, tied: bool) -> None:
    model, tokenizer = tiny_backbone()
    weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    module = ReFTModule.from_model(model, tokenizer, lr=0.1, interventions=[
        {"node": NODE, "kind": kind, "rank": 4, "positions": "f1+l2", "tied": tied}])
    assert len(module.intervention.trainable) == (1 if tied else 2)
    data = ContinuationDataModule(_write(tmp_path / "train.jsonl", _continuations()), batch_size=4, shuffle=False)
    data.setup()
    first = module.evaluate(data.train_records)
    assert first["nll"] == pytest.approx(first["base_nll"], abs=1e-4) if kind == "add" else True
    _trainer(20).fit(module, datamodule=data)
    last = module.evaluate(data.train_records)
    assert last["nll"] < first["nll"] - 0.5 and last["base_nll"] == pytest.approx(first["base_nll"], abs=1e-5)
    for name, p in model.named_parameters():
        assert torch.equal(p, weights[name]), name
    assert module.parameter_count() == {"loreft": 2 * (2 * 4 * 64 + 4), "direft": 2 * 4 * 64 + 4, "add": 64}[kind]


def test_bipo_trains_a_steering_vector_and_caa_is_the_mean_difference(tmp_path: Path) -> None:
    model, tokenizer = tiny_backbone()
    module = ReFTModule.from_model(model, tokenizer, lr=0.05, objective=BiPOObjective(beta=0.5),
                                   interventions=[{"node": NODE, "kind": "steer"}])
    data = PreferenceDataModule(_write(tmp_path / "train.jsonl", _preferences()), batch_size=4)
    data.setup()
    assert module.evaluate(data.train_records)["logratio_margin"] == pytest.approx(0.0, abs=1e-5)
    _trainer(10).fit(module, datamodule=data)
    after = module.evaluate(data.train_records)
    assert after["logratio_margin"] > 0.5 and after["preference_accuracy"] == 1.0
    records = [PreferenceRecord(**r) for r in _preferences()]
    vector = caa_vector(module, NODE, records, batch_size=3)
    prompts = [r.prompt for r in records]
    manual = torch.stack([continuation_mean_activations(module, NODE, [p], [c])[0]
                          - continuation_mean_activations(module, NODE, [p], [r])[0]
                          for p, c, r in zip(prompts, [r.chosen for r in records], [r.rejected for r in records])])
    torch.testing.assert_close(vector, manual.mean(0), rtol=0, atol=1e-5)


def test_gradpatch_fit_loreft_config_then_generate(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model_dir = save_tiny_backbone(tmp_path / "model")
    root = tmp_path / "run"
    status = cli.main(["fit", "--config", str(CONFIGS / "loreft_country.yaml"), "--model.model_path", str(model_dir),
                       "--model.interventions", f'[{{"node": "{NODE}", "kind": "loreft", "rank": 2, '
                       f'"positions": "f1+l1", "tied": false}}]',
                       "--data.train_file", _write(tmp_path / "train.jsonl", _continuations()),
                       "--data.eval_file", _write(tmp_path / "eval.jsonl", _continuations()[:2]),
                       "--data.batch_size", "2", "--trainer.max_steps", "3", "--trainer.val_check_interval", "2",
                       "--trainer.default_root_dir", str(root)])
    assert status == 0
    metrics = json.loads((root / "metrics.json").read_text())
    assert metrics["examples"] == 2 and metrics["steps"] == 3 and metrics["parameters"] == 2 * (2 * 2 * 64 + 2)
    assert {"nll", "base_nll"} <= set(metrics)
    capsys.readouterr()
    assert cli.main(["generate", "--intervention", str(root / "intervention"), "--model", str(model_dir),
                     "--prompt", "the city Rome is in the country", "--max-new-tokens", "3", "--compare"]) == 0
    out = capsys.readouterr().out
    assert "intervened:" in out and "model:" in out
    assert cli.main(["generate", "--intervention", str(root / "intervention"), "--model", str(model_dir),
                     "--prompt", "the"]) == 2  # one token: positions f1+l1 need two
    assert "need 2 prompt tokens" in capsys.readouterr().err
    model, tokenizer = tiny_backbone()
    for spec, reason in (({"rank": 3, "positions": "f1+l1", "tied": False}, "rank=2"),
                         ({"rank": 2, "positions": "f2+l1", "tied": False}, "positions"),
                         ({"rank": 2, "positions": "f1+l1", "tied": True}, "untied")):
        other = ReFTModule.from_model(model, tokenizer, interventions=[{"node": NODE, "kind": "loreft", **spec}])
        with pytest.raises(InterventionLoadError, match=reason):
            other.load_intervention(root / "intervention")
    same = ReFTModule.from_model(model, tokenizer, interventions=[
        {"node": NODE, "kind": "loreft", "rank": 2, "positions": "f1+l1", "tied": False}])
    same.load_intervention(root / "intervention")
    assert same.generate(["the city Rome is in the country"], max_new_tokens=3)[0] in out


def test_bipo_config_parses(tmp_path: Path) -> None:
    model_dir = save_tiny_backbone(tmp_path / "model")
    root = tmp_path / "run"
    status = cli.main(["fit", "--config", str(CONFIGS / "bipo_sentiment.yaml"), "--model.model_path", str(model_dir),
                       "--model.interventions", f'[{{"node": "{NODE}", "kind": "steer"}}]',
                       "--data.train_file", _write(tmp_path / "train.jsonl", _preferences()),
                       "--data.eval_file", _write(tmp_path / "eval.jsonl", _preferences()[:2]),
                       "--data.batch_size", "2", "--trainer.max_steps", "2", "--trainer.val_check_interval", "2",
                       "--trainer.default_root_dir", str(root)])
    assert status == 0
    metrics = json.loads((root / "metrics.json").read_text())
    assert metrics["parameters"] == 64 and {"logratio_margin", "preference_accuracy"} <= set(metrics)


def test_generation_applies_reft_at_the_prefill_only_and_batches_like_single_prompts() -> None:
    from gradpatch import LoReFTPatch
    from gradpatch.interventions.reft import reft_patch_map
    from recipes.generation import generate_with_patches

    model, tokenizer = tiny_backbone()
    module = ReFTModule.from_model(model, tokenizer, interventions=[{"node": NODE, "kind": "steer"}])
    torch.manual_seed(3)
    patch = LoReFTPatch(64, 2, positions="f1+l1")
    with torch.no_grad():
        patch.projection.bias.fill_(3.0)
    patches = {NODE: [patch]}
    prompts = ["the city Paris is in the country", "I feel"]
    batched = generate_with_patches(module.graph, tokenizer, patches, prompts, max_new_tokens=4, batch_size=2)
    alone = [generate_with_patches(module.graph, tokenizer, patches, [p], max_new_tokens=4)[0] for p in prompts]
    plain = generate_with_patches(module.graph, tokenizer, {}, prompts, max_new_tokens=4, batch_size=2)
    assert batched == alone and batched != plain
    # without a cache, the same tokens follow from patching the prompt's positions only in each full forward
    ids = tokenizer(prompts[1])["input_ids"]
    for _ in range(4):
        with module.graph.patch(reft_patch_map(patches, [2])):
            logits = module.graph(torch.tensor([ids]), use_cache=False).logits
        ids.append(int(logits[0, -1].argmax()))
    assert tokenizer.decode(ids[2:], skip_special_tokens=True) == alone[1]
