"""A converged edit wins on its own rewrite prompt (issue 50): ROME's value search runs through the rank-one update the
edit writes, and an edit that still loses there is reported as not converged, never applied silently."""

from __future__ import annotations

import pytest
import torch

from editors import ROME, Corpus, EditRequest, ROMEConfig, ValueObjective, resolve_layer
from editors.errors import EditNotConvergedError
from editors.passes.scoring import mean_target_logprobs
from editors.solve.rank_one import update_direction
from editors.statistics.keys import context_activations
from gradpatch import PatchableGraph
from gradpatch.testing import TOY_SENTENCES, byte_level_tokenizer, tiny_llama

NODE = "model.layers_0.mlp.down_proj"


def _rome(tmp_path, **settings) -> tuple[PatchableGraph, ROME]:
    torch.manual_seed(0)
    tok = byte_level_tokenizer()
    pg = PatchableGraph(tiny_llama(len(tok)), torch.randint(0, len(tok), (2, 6)), use_cache=False).eval()
    config = ROMEConfig(**{"n_samples": 32, "max_length": 64, "cache_dir": str(tmp_path), "progress": False,
                           "steps": 10, "clamp_factor": 500.0, "context_length_params": ((5, 4), (10, 4))} | settings)
    return pg, ROME(pg, tok, NODE, config, corpus=Corpus(name="toy", texts=list(TOY_SENTENCES) * 4))


def test_search_through_the_update_reads_the_edited_model(tmp_path) -> None:
    """With the update's direction ``u``, the objective at ``δ`` is the plain objective on the model with ``W + δ uᵀ``
    written: what the search optimises is what the edit does, at every prompt and position."""
    pg, rome = _rome(tmp_path)
    request = EditRequest(prompt="{} is located in the city of", subject="the old town", target_new="Rome")
    layer, templates = rome.layer, rome.templates()
    keys = context_activations(pg, rome.tokenizer, [layer.input_node], [(request.prompt, request.subject)],
                               templates)[0][0]  # [P, d_in]
    key = keys.mean(dim=0)
    u = update_direction(key, rome.statistics().matrix).to(key.dtype)
    assert not torch.allclose(keys.double() @ u.double(), torch.ones(len(keys), dtype=torch.float64), atol=1e-2)
    v0 = layer.forward_value(key).detach()
    delta = torch.randn_like(v0) * 0.5 * float(v0.norm())
    through = ValueObjective(pg, rome.tokenizer, layer, request, templates, v0, direction=u)
    at_subject = ValueObjective(pg, rome.tokenizer, layer, request, templates, v0)
    with torch.no_grad():
        searched = through.loss(delta)
        plain = at_subject.loss(delta)
        original = layer.weight.detach().clone()
        layer.weight.add_(layer.delta_weight(u, delta))
        try:
            edited = at_subject.loss(torch.zeros_like(delta))
        finally:
            layer.weight.copy_(original)
    assert float(searched["nll"]) == pytest.approx(float(edited["nll"]), rel=1e-4, abs=1e-5)
    assert float(searched["target_prob"]) == pytest.approx(float(edited["target_prob"]), rel=1e-4, abs=1e-6)
    assert abs(float(plain["nll"]) - float(edited["nll"])) > 1e-3  # δ at the subject alone is another model


def test_a_converged_search_that_loses_its_rewrite_prompt_is_not_converged(tmp_path) -> None:
    """A search that stops at once (its loss below a loose threshold, ``δ = 0``) reports convergence, yet the edit
    leaves the rewrite prompt preferring the true target: the edit must say it is not converged and refuse to apply."""
    pg, rome = _rome(tmp_path, early_stop_loss=1e9)
    prompt, subject = "I think the bridge is in {}", "the old town"
    text = prompt.format(subject)
    forward = lambda ids: pg(ids, use_cache=False)  # noqa: E731
    rome_lp = mean_target_logprobs(forward, rome.tokenizer, [text] * 2, ["Rome", "Paris"])
    new, true = ("Rome", "Paris") if rome_lp[0] < rome_lp[1] else ("Paris", "Rome")  # the unedited model's loser
    request = EditRequest(prompt=prompt, subject=subject, target_new=new, target_true=true)
    edit = rome.compute(request)
    assert rome.last_value is not None and rome.last_value.converged(1e9)  # the search says it converged
    assert edit.info["rewrite"]["wins"] is False
    assert edit.info["rewrite"]["logp_new"] < edit.info["rewrite"]["logp_true"]
    assert edit.info["converged"] is False
    original = resolve_layer(pg, NODE).weight.detach().clone()
    with pytest.raises(EditNotConvergedError, match="loses on its own rewrite prompt"):
        rome.edit(request)
    assert torch.equal(resolve_layer(pg, NODE).weight, original)


def test_an_edit_that_wins_records_it(tmp_path) -> None:
    pg, rome = _rome(tmp_path, steps=25)
    request = EditRequest(prompt="The river flows into the sea near {}", subject="the old town", target_new="Rome",
                          target_true="Paris")
    edit = rome.edit(request)
    rewrite = edit.info["rewrite"]
    assert rewrite["wins"] is True and edit.info["converged"] is True
    forward = lambda ids: pg(ids, use_cache=False)  # noqa: E731
    after = mean_target_logprobs(forward, rome.tokenizer, [request.text] * 2, ["Rome", "Paris"])
    assert float(after[0]) == pytest.approx(rewrite["logp_new"], abs=1e-4)  # the check scored the applied edit
    assert float(after[1]) == pytest.approx(rewrite["logp_true"], abs=1e-4)
    edit.restore(pg)
