"""The KL prompt read behind a context prefix (``kl_in_context``, issue 50): the essence prompt "{subject} is a" no
longer begins the text, so the KL term holds the subject's reading mid-text, not at the start of the text."""

from __future__ import annotations

import pytest
import torch

import editors.rome as rome_module
from editors import (ROME, ContextPrefixes, Corpus, EditRequest, MEMITConfig, ROMEConfig, ValueObjective, compute_key,
                     resolve_layer)
from editors.value.batch_objective import BatchValueObjective
from editors.value.search import KL_PROMPT, encode_value_prompts, kl_context_prefix
from gradpatch import PatchableGraph
from gradpatch.testing import TOY_SENTENCES, byte_level_tokenizer, tiny_llama

TEMPLATES = ContextPrefixes(prefixes=("", "The river flows. ", "I think you know. "))
REQUESTS = [EditRequest("The capital of {} is", "France", "London"),
            EditRequest("{} plays the", "the old town", "drums")]
NODE = "model.layers_0.mlp.down_proj"


def test_kl_context_prefix_is_the_first_non_empty_prefix() -> None:
    assert kl_context_prefix(TEMPLATES, False) == ""
    assert kl_context_prefix(TEMPLATES, True) == "The river flows. "
    assert kl_context_prefix(TEMPLATES.subset(2), True) == "The river flows. "  # every subset keeps it
    with pytest.raises(ValueError, match="kl_in_context=False"):
        kl_context_prefix(ContextPrefixes(prefixes=("",)), True)


def test_kl_prompt_is_encoded_behind_the_prefix() -> None:
    tok = byte_level_tokenizer()
    request = REQUESTS[1]
    plain = encode_value_prompts(tok, request, TEMPLATES)
    behind = encode_value_prompts(tok, request, TEMPLATES, kl_prefix="The river flows. ")
    assert plain.sequences[:-1] == behind.sequences[:-1]  # the rewriting prompts are the same
    text = "The river flows. " + KL_PROMPT.format(request.subject)
    assert behind.sequences[-1] == list(tok(text)["input_ids"])
    subject_last = behind.subject_positions[-1]
    assert tok.decode(behind.sequences[-1][: subject_last + 1]).endswith(request.subject)
    assert subject_last > plain.subject_positions[-1]  # the subject no longer begins the text


def test_batched_and_one_fact_objectives_read_the_same_kl_prompt() -> None:
    """The KL term behind the prefix is another number than at the start of the text, and MEMIT's batched objective
    computes ROME's one-fact terms for it exactly."""
    torch.manual_seed(0)
    tok = byte_level_tokenizer()
    pg = PatchableGraph(tiny_llama(len(tok)), torch.randint(0, len(tok), (2, 6)), use_cache=False).eval()
    layer = resolve_layer(pg, NODE)
    v0 = torch.stack([layer.forward_value(compute_key(pg, tok, layer, r.prompt, r.subject, TEMPLATES))
                      for r in REQUESTS]).detach()
    batched = BatchValueObjective(pg, tok, layer, REQUESTS, TEMPLATES, v0, kl_in_context=True)
    batched.loss(torch.zeros_like(v0), [0, 1])  # the KL references, at δ = 0
    delta = torch.randn_like(v0) * 0.5 * v0.norm(dim=-1, keepdim=True)
    terms = batched.loss(delta, [0, 1])
    for fact, request in enumerate(REQUESTS):
        single = ValueObjective(pg, tok, layer, request, TEMPLATES, v0[fact], kl_in_context=True)
        start = ValueObjective(pg, tok, layer, request, TEMPLATES, v0[fact])
        for objective in (single, start):
            objective.loss(torch.zeros(layer.d_out))
        one, first = single.loss(delta[fact]), start.loss(delta[fact])
        assert float(terms["kl"][fact].detach()) == pytest.approx(float(one["kl"].detach()), rel=1e-4, abs=1e-6)
        # only the KL prompt moved
        assert float(one["nll"].detach()) == pytest.approx(float(first["nll"].detach()), rel=1e-5)
        assert abs(float(one["kl"].detach()) - float(first["kl"].detach())) > 1e-4


def test_rome_reads_the_kl_prompt_behind_the_prefix_by_default(monkeypatch) -> None:
    """ROME's default puts the KL prompt behind the first context prefix; MEMIT's (and AlphaEdit's) keep the paper's,
    and the setting reaches the objective the editor builds."""
    assert ROMEConfig().kl_in_context is True and MEMITConfig().kl_in_context is False
    torch.manual_seed(0)
    tok = byte_level_tokenizer()
    pg = PatchableGraph(tiny_llama(len(tok)), torch.randint(0, len(tok), (2, 6)), use_cache=False).eval()
    built: list[ValueObjective] = []
    original = rome_module.ValueObjective

    def recording(*args, **kwargs):
        built.append(original(*args, **kwargs))
        return built[-1]

    monkeypatch.setattr(rome_module, "ValueObjective", recording)
    for in_context in (True, False):
        config = ROMEConfig(n_samples=16, max_length=32, use_cache=False, progress=False, steps=2,
                            allow_unconverged=True, context_length_params=((5, 2),), kl_in_context=in_context)
        rome = ROME(pg, tok, NODE, config, corpus=Corpus(name="toy", texts=list(TOY_SENTENCES) * 2))
        rome.compute(REQUESTS[0])
        kl_text = tok.decode(built[-1].input_ids[int(built[-1].kl_rows[0])])
        prefix = rome.templates().prefixes[1]
        assert (prefix + "France is a" in kl_text) is in_context and "France is a" in kl_text
