"""The editors' public surface after the move into sub-packages: the front page's names, the shared ``Editor`` base
and the ``editor_for`` factory, and eval-rome's ``--n-cases``."""

from __future__ import annotations

import warnings

import pytest
import torch

import editors
import gradpatch
from editors import MEMIT, ROME, AlphaEdit, Editor, config_for, editor_for
from editors.config import MEMITConfig, ROMEConfig
from editors.errors import EditFingerprintError, EditNotConvergedError
from editors.evaluation import evaluate_sequential
from gradpatch import PatchableGraph
from gradpatch.errors import NonFiniteError
from gradpatch.testing import TOY_SENTENCES, byte_level_tokenizer, tiny_llama

NODES = ["model.layers_0.mlp.down_proj", "model.layers_1.mlp.down_proj"]
SETTINGS = dict(n_samples=8, max_length=32, progress=False, use_cache=False)


@pytest.fixture
def graph():
    tok = byte_level_tokenizer()
    pg = PatchableGraph(tiny_llama(len(tok)), torch.randint(0, len(tok), (2, 6)), use_cache=False)
    return pg.eval(), tok


def test_front_page_names():
    assert editors.EditNotConvergedError is EditNotConvergedError
    assert editors.EditFingerprintError is EditFingerprintError
    assert editors.evaluate_sequential is evaluate_sequential
    assert gradpatch.NonFiniteError is NonFiniteError and "NonFiniteError" in gradpatch.__all__
    for name in ("update_direction", "BatchValueObjective", "ContextTemplates"):
        assert name not in editors.__all__ and name not in dir(editors)


def test_front_page_names_do_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for name in editors.__all__:
            getattr(editors, name)


def test_config_for_checks_settings_before_any_model():
    assert config_for("rome", steps=3) == ROMEConfig(steps=3)
    assert type(config_for("alphaedit")).__name__ == "AlphaEditConfig"
    with pytest.raises(ValueError, match="pick one of rome, memit, alphaedit"):
        config_for("lora")
    with pytest.raises(ValueError, match="rome has no setting mom2_update_weight; its settings: .*steps"):
        config_for("rome", mom2_update_weight=1.0)
    with pytest.raises(ValueError, match="true_logit_weight"):
        config_for("memit", true_logit_weight=-1.0)


def test_editor_for_builds_each_method_on_the_shared_base(graph):
    pg, tok = graph
    # ROME and MEMIT read the texts after the same start token by default, so the two share their statistics
    rome = editor_for("rome", pg, tok, NODES[:1], config_for("rome", **SETTINGS), corpus=list(TOY_SENTENCES))
    memit = editor_for("memit", pg, tok, NODES, config_for("memit", **SETTINGS), corpus=list(TOY_SENTENCES))
    alpha = editor_for("alphaedit", pg, tok, NODES)
    assert type(rome) is ROME and type(memit) is MEMIT and type(alpha) is AlphaEdit
    assert all(isinstance(e, Editor) for e in (rome, memit, alpha))
    assert (rome.method, memit.method, alpha.method) == ("rome", "memit", "alphaedit")
    assert rome.nodes == NODES[:1] and memit.nodes == NODES and alpha.config == config_for("alphaedit")
    assert rome.cache_dir() is None and alpha.cache_dir() is not None
    # one statistics code path: ROME's single C is the first of the base's list, and equals MEMIT's at that layer
    assert torch.equal(rome.statistics().matrix, rome.layer_statistics()[0].matrix)
    assert torch.equal(rome.statistics().matrix, memit.statistics()[0].matrix)
    assert rome.templates() == memit.templates()
    with pytest.raises(ValueError, match="ROME edits one layer; got 2"):
        editor_for("rome", pg, tok, NODES)
    with pytest.raises(ValueError, match="memit takes a MEMITConfig, got a ROMEConfig"):
        editor_for("memit", pg, tok, NODES, ROMEConfig())
    with pytest.raises(ValueError, match="pick one of"):
        editor_for("lora", pg, tok, NODES, MEMITConfig())


def test_training_mode_is_refused_by_every_editor(graph):
    pg, tok = graph
    pg.train()
    for method in ("rome", "memit"):
        editor = editor_for(method, pg, tok, NODES[:1], config_for(method, **SETTINGS))
        with pytest.raises(editors.EditError, match="training mode"):
            editor.check_eval()


def test_eval_rome_takes_n_cases():
    from recipes.cli import build_parser

    parser = build_parser()
    base = ["eval-rome", "--cases", "c.json", "--out", "o.json"]
    assert parser.parse_args([*base, "--n-cases", "4"]).n_cases == 4
    assert parser.parse_args(base).n_cases is None
