"""Optimisations stop at the first non-finite loss term, gradient or update; diverged edits are not applied."""

from __future__ import annotations

import warnings

import pytest
import torch
import yaml
from lightning.pytorch import Trainer
from torch import nn

from editors import ROME, Corpus, EditRequest, ROMEConfig, ValueResult, optimize_value
from editors.errors import EditNotConvergedError
from gradpatch.errors import NonFiniteError
from gradpatch.testing import TOY_SENTENCES, byte_level_tokenizer, tiny_llama
from recipes import DeltaModule, DeltaSpec, Objective, ObjectiveModule, RecipeConfigError, TargetSpec
from recipes.editing.rome_value import LightningValueRunner
from recipes.testing import save_tiny_backbone, tiny_backbone

RUNNERS = {"plain": optimize_value, "lightning": LightningValueRunner()}


def _trainer(max_steps: int) -> Trainer:
    return Trainer(max_steps=max_steps, accelerator="cpu", logger=False, enable_checkpointing=False,
                   enable_progress_bar=False, enable_model_summary=False)


@pytest.fixture(scope="module")
def backbone():
    torch.set_num_threads(1)
    return tiny_backbone()


def _delta_module(backbone, lr: float) -> DeltaModule:
    return DeltaModule.from_model(*backbone, deltas=[DeltaSpec("model.layers_1.output", "last")],
                                  objective=Objective(targets=[TargetSpec("the city of", " Rome")], l2_weight=1e-4),
                                  lr=lr)


def test_delta_module_stops_at_the_first_non_finite_term(backbone, tmp_path) -> None:
    module = _delta_module(backbone, lr=1e20)  # step 0 moves the delta to ~1e20: its squared norm overflows
    with pytest.raises(NonFiniteError, match=r"DeltaModule: term 'l2', 'norm/0', 'loss' is non-finite at step 1 "
                                             r"\(.*l2=inf.*\); lower the learning rate \(lr=1e\+20\)"):
        _trainer(10).fit(module)


@pytest.mark.parametrize("kind", ["DeltaModule", "ObjectiveModule"])
def test_an_overflowing_update_is_our_error(kind: str, backbone) -> None:
    if kind == "DeltaModule":
        module = _delta_module(backbone, lr=1e38)
    else:
        pg = _delta_module(backbone, lr=0.1).graph
        module = ObjectiveModule(pg, {"x": torch.zeros(4)}, lambda v: {"loss": (v["x"] - 1).pow(2).sum()}, lr=1e38)
    with pytest.raises(NonFiniteError, match=rf"{kind}: the optimizer update at step 0 overflowed .*lr=1e\+38"):
        _trainer(3).fit(module)


def test_objective_module_stops_at_a_non_finite_gradient(backbone) -> None:
    pg = _delta_module(backbone, lr=0.1).graph
    # sqrt(|x|) at x = 0: a finite loss whose gradient is 0 * inf = NaN.
    module = ObjectiveModule(pg, {"x": torch.zeros(3)}, lambda v: {"loss": v["x"].abs().sqrt().sum()}, lr=0.1)
    with pytest.raises(NonFiniteError, match=r"the gradient of 'values.x' is non-finite at step 0 .*loss=0"):
        _trainer(3).fit(module)
    assert torch.equal(module.values["x"].detach(), torch.zeros(3))  # stopped before the update


@pytest.mark.parametrize("lr", [0.0, -1.0, float("nan"), float("inf")])
def test_learning_rates_are_checked_at_the_door(lr: float, backbone) -> None:
    with pytest.raises(RecipeConfigError, match="finite positive"):
        _delta_module(backbone, lr=lr)


def test_export_refuses_non_finite_deltas(backbone, tmp_path) -> None:
    module = _delta_module(backbone, lr=0.1)
    with torch.no_grad():
        module.deltas[0][5] = float("nan")
    with pytest.raises(NonFiniteError, match="model.layers_1.output"):
        module.export_intervention(tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_fit_command_reports_a_diverged_run(tmp_path, capsys) -> None:
    from recipes.cli import main

    model_dir = save_tiny_backbone(tmp_path / "tiny")
    config = {"trainer": {"max_steps": 2, "accelerator": "cpu", "enable_progress_bar": False, "logger": False,
                          "enable_checkpointing": False, "default_root_dir": str(tmp_path)},  # config.yaml goes there
              "model": {"deltas": [{"node": "model.layers_1.output", "position": "last"}],
                        "objective": {"targets": [{"prompt": "the city of", "target": " Rome"}]}, "lr": 1e38}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
    status = main(["fit", "--config", str(tmp_path / "c.yaml"), "--model", str(model_dir),
                   "--export", str(tmp_path / "out")])
    assert status == 1 and "overflowed" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


class FakeObjective:
    """A ValueObjective stand-in: ``‖δ - 1‖²``, with the ``nll`` term turning NaN at evaluation ``nan_at``."""

    def __init__(self, nan_at: int) -> None:
        self.pg = nn.Linear(2, 2)
        self.v_init = torch.zeros(4)
        self.device = torch.device("cpu")
        self.nan_at, self.calls = nan_at, 0

    def loss(self, delta: torch.Tensor) -> dict[str, torch.Tensor]:
        nll = (delta - 1).pow(2).sum() * (float("nan") if self.calls >= self.nan_at else 1.0)
        self.calls += 1
        return {"loss": nll, "nll": nll, "kl": nll.new_zeros(()), "weight_decay": nll.new_zeros(()),
                "target_prob": nll.new_ones(())}

    def project_(self, delta: torch.Tensor) -> None:
        return None


@pytest.mark.parametrize("runner", sorted(RUNNERS))
def test_value_runners_stop_at_the_first_non_finite_loss(runner: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(NonFiniteError, match=r"ROME value step: term 'loss', 'nll' is non-finite at step 2"):
            RUNNERS[runner](FakeObjective(nan_at=2), steps=10, lr=0.1, early_stop_loss=0.0)


@pytest.mark.parametrize("lr", [0.0, float("nan")])
def test_the_plain_value_runner_checks_its_learning_rate(lr: float) -> None:
    with pytest.raises(ValueError, match="finite positive"):
        optimize_value(FakeObjective(nan_at=99), steps=1, lr=lr, early_stop_loss=0.0)


def test_convergence_is_judged_on_the_loss_history() -> None:
    def result(*losses: float) -> ValueResult:
        return ValueResult(delta=torch.zeros(1), v_star=torch.zeros(1), steps=len(losses),
                           history=[{"loss": loss} for loss in losses])

    assert result(3.0, 1.0).converged(0.05) and result(0.01).converged(0.05)
    assert not result(3.0, 4.0).converged(0.05) and not result(3.0).converged(0.05)
    assert not result(3.0, float("nan")).converged(0.05) and not result().converged(0.05)


REQUEST = EditRequest(prompt="The river flows into the sea near {}", subject="the old town", target_new="Rome")


@pytest.fixture(scope="module")
def graph_and_tokenizer():
    from gradpatch import PatchableGraph

    tok = byte_level_tokenizer()
    pg = PatchableGraph(tiny_llama(len(tok)), torch.randint(0, len(tok), (2, 6)), use_cache=False).eval()
    return pg, tok


def _rome(graph_and_tokenizer, tmp_path, runner: str, **config) -> ROME:
    pg, tok = graph_and_tokenizer
    settings = dict(n_samples=16, max_length=32, cache_dir=str(tmp_path), progress=False, steps=4,
                    context_length_params=((3, 1),), value_prefixes=None)
    settings.update(config)
    return ROME(pg, tok, "model.layers_0.mlp.down_proj", ROMEConfig(**settings),
                corpus=Corpus(name="toy", texts=list(TOY_SENTENCES)), value_runner=RUNNERS[runner])


@pytest.mark.parametrize("runner", sorted(RUNNERS))
def test_rome_lr_overflow_is_our_error_and_leaves_the_weights(runner: str, graph_and_tokenizer, tmp_path) -> None:
    rome = _rome(graph_and_tokenizer, tmp_path, runner, lr=1e38)
    original = rome.layer.weight.detach().clone()
    with pytest.raises(NonFiniteError, match=r"ROME value step: the optimizer update at step 0 overflowed"):
        rome.edit(REQUEST)
    assert torch.equal(rome.layer.weight, original)


@pytest.mark.parametrize("runner", sorted(RUNNERS))
def test_a_diverged_value_search_is_not_applied(runner: str, graph_and_tokenizer, tmp_path) -> None:
    rome = _rome(graph_and_tokenizer, tmp_path, runner, lr=1e6, clamp_factor=1e30)  # the clamp off: diverges
    original = rome.layer.weight.detach().clone()
    with pytest.raises(EditNotConvergedError, match="did not converge"):
        rome.edit(REQUEST)
    assert torch.equal(rome.layer.weight, original)
    rome.config.allow_unconverged = True
    edit = rome.edit(REQUEST)
    assert edit.info["converged"] is False and edit.info["loss"] > edit.info["first_loss"]
    edit.restore(rome.pg)
    assert torch.equal(rome.layer.weight, original)
