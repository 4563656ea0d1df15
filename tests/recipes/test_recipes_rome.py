"""The ROME recipe: the value step under Trainer.fit, its TensorBoard run, and the ``gradpatch rome`` command."""

from __future__ import annotations

import json

import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from editors import ROME, Corpus, EditRequest, ROMEConfig, ValueObjective, compute_key, load_edits, optimize_value
from gradpatch.testing import TOY_SENTENCES, byte_level_tokenizer, tiny_llama
from recipes.editing.rome_recipe import run_rome
from recipes.editing.rome_value import LightningValueRunner

# As in test_rome_pipeline: the toy fact ends with its subject, and the clamp is loosened for a random model.
REQUEST = EditRequest(prompt="The river flows into the sea near {}", subject="the old town", target_new="Rome",
                      target_true="Paris")


def _rome(tmp_path, runner=optimize_value) -> ROME:
    from gradpatch import PatchableGraph

    tok = byte_level_tokenizer()
    torch.manual_seed(0)
    model = tiny_llama(len(tok))
    pg = PatchableGraph(model, torch.randint(0, len(tok), (2, 6)), use_cache=False).eval()
    config = ROMEConfig(n_samples=32, max_length=64, cache_dir=str(tmp_path / "cache"), progress=False, steps=6,
                        clamp_factor=500.0, context_length_params=((5, 2), (10, 2)))
    return ROME(pg, tok, "model.layers_0.mlp.down_proj", config,
                corpus=Corpus(name="toy", texts=list(TOY_SENTENCES) * 4), value_runner=runner)


def _objective(rome: ROME) -> ValueObjective:
    key = compute_key(rome.pg, rome.tokenizer, rome.layer, REQUEST.prompt, REQUEST.subject, rome.templates())
    v0 = rome.layer.forward_value(key).detach()
    return ValueObjective(rome.pg, rome.tokenizer, rome.layer, REQUEST, rome.templates(), v0, clamp_factor=0.5)


def test_lightning_runner_matches_the_plain_loop(tmp_path) -> None:
    rome = _rome(tmp_path)
    flags = [p.requires_grad for p in rome.pg.parameters()]
    plain = optimize_value(_objective(rome), steps=5, lr=0.5, early_stop_loss=0.0)
    seen: list[int] = []
    fitted = LightningValueRunner()(_objective(rome), steps=5, lr=0.5, early_stop_loss=0.0,
                                    callback=lambda step, terms: seen.append(step))
    # One objective, two runners: the same Adam steps from δ = 0, the same clamp after each step.
    assert fitted.steps == plain.steps == 5
    assert torch.allclose(fitted.delta, plain.delta, rtol=1e-4, atol=1e-6)
    assert torch.allclose(torch.tensor([h["loss"] for h in fitted.history]),
                          torch.tensor([h["loss"] for h in plain.history]), rtol=1e-4)
    assert seen == list(range(5))
    assert float(fitted.delta.norm()) <= 0.5 * float(_objective(rome).v_init.norm()) * (1 + 1e-5)  # clamped
    assert [p.requires_grad for p in rome.pg.parameters()] == flags  # the model is unfrozen again afterwards


def test_lightning_runner_stops_early_like_the_plain_loop(tmp_path) -> None:
    rome = _rome(tmp_path)
    plain = optimize_value(_objective(rome), steps=5, lr=0.5, early_stop_loss=1e9)
    fitted = LightningValueRunner()(_objective(rome), steps=5, lr=0.5, early_stop_loss=1e9)
    assert plain.steps == fitted.steps == 0 and len(fitted.history) == 1
    assert torch.count_nonzero(fitted.delta) == 0


def test_run_rome_logs_the_edit_to_tensorboard(tmp_path) -> None:
    runner = LightningValueRunner(logdir=tmp_path / "runs", name="rome")
    rome = _rome(tmp_path, runner)
    original = rome.layer.weight.detach().clone()
    result = run_rome(rome, REQUEST, prompts=["I think the bridge is in the old town"], max_new_tokens=2)
    assert result.prompts[0] == REQUEST.text and len(result.before) == len(result.after) == 2
    assert result.probabilities["after"]["new"] > result.probabilities["before"]["new"]
    assert not torch.equal(rome.layer.weight, original)
    events = EventAccumulator(result.log_dir, size_guidance={"scalars": 0, "tensors": 0}).Reload()
    scalars = set(events.Tags()["scalars"])
    node = "model.layers_0.mlp.down_proj.output"
    assert {"loss/total", "loss/nll", "loss/kl", "loss/weight_decay", "prob/target",
            f"delta_norm/{node}@subject_last", "edit/p_new_before", "edit/p_new_after",
            "edit/p_true_before", "edit/p_true_after"} <= scalars
    losses = [e.value for e in events.Scalars("loss/total")]
    assert len(losses) == result.edit.info["steps"] and losses[-1] < losses[0]
    assert events.Scalars("edit/p_new_after")[0].value == float(torch.tensor(result.probabilities["after"]["new"]))
    text_tags = {t.split("/")[0] for t in events.Tags()["tensors"]}
    assert {"generations", "edit"} <= text_tags
    table = events.Tensors("generations/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "before the edit" in table and REQUEST.text in table
    result.edit.restore(rome.pg)
    assert torch.equal(rome.layer.weight, original)


def test_rome_command(tmp_path, capsys) -> None:
    from recipes.cli import main

    tok = byte_level_tokenizer()
    torch.manual_seed(0)
    model_dir = tmp_path / "model"
    tiny_llama(len(tok)).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(list(TOY_SENTENCES) * 4), encoding="utf-8")
    args = ["rome", "--subject", REQUEST.subject, "--prompt", REQUEST.prompt, "--target-new", " Rome",
            "--target-true", "Paris", "--model", str(model_dir), "--node", "model.layers_0.mlp.down_proj",
            "--device", "cpu", "--corpus", str(corpus), "--n-samples", "32", "--steps", "1",
            "--cache-dir", str(tmp_path / "cache"), "--logdir", str(tmp_path / "runs"),
            "--save", str(tmp_path / "edit"), "--max-new-tokens", "2", "--quiet"]
    # One step under the paper's clamp does not make a random tiny model prefer " Rome": the edit is refused (it loses
    # on its own rewrite prompt) unless applied anyway.
    assert main(args) == 1
    assert "loses on its own rewrite prompt" in capsys.readouterr().err
    args.append("--allow-unconverged")
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "P('Rome')" in out and "before:" in out and "after:" in out
    assert f"tensorboard --logdir {tmp_path / 'runs'}" in out
    edit = load_edits(tmp_path / "edit")[0]
    assert edit.node == "model.layers_0.mlp.down_proj" and edit.request.target_new == "Rome"
    assert json.loads((tmp_path / "edit" / "edit.json").read_text())
    # --model without --node names the fix.
    assert main(["rome", "--subject", "x", "--prompt", "{} is", "--target-new", "y", "--model", str(model_dir)]) == 2
    assert "--model needs --node" in capsys.readouterr().err
