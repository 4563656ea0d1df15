"""The start token (editors.passes.start_token): which token, the tokenizer copy, the editors' use of it and its
cache keys."""

from __future__ import annotations

import json

import pytest
import torch

from editors import MEMIT, ROME, AlphaEdit, AlphaEditConfig, Corpus, EditRequest, MEMITConfig, ROMEConfig, compute_key
from editors.passes import encode_subject_prompt, resolve_start_token, start_token_tag, with_start_token
from gradpatch import PatchableGraph
from gradpatch.testing import TOY_SENTENCES, byte_level_tokenizer, metaspace_tokenizer, tiny_gpt2


def test_auto_picks_the_document_separator_and_leaves_the_callers_tokenizer() -> None:
    tok = byte_level_tokenizer()
    assert resolve_start_token(tok, "auto") == "<|endoftext|>"
    plain = list(tok("The old town")["input_ids"])
    prefixed = with_start_token(tok, "auto")
    separator = tok.convert_tokens_to_ids("<|endoftext|>")
    assert list(prefixed("The old town")["input_ids"]) == [separator, *plain]
    assert list(tok("The old town")["input_ids"]) == plain  # the caller's tokenizer is unchanged
    assert start_token_tag(tok) == "" and start_token_tag(prefixed) == f"__start{separator}"
    # the subject's last token moves one position right, and the start token never counts as subject
    first = encode_subject_prompt(tok, "The old town is", (0, 3))
    shifted = encode_subject_prompt(prefixed, "The old town is", (0, 3))
    assert shifted.subject_last == first.subject_last + 1 and shifted.ids[1:] == first.ids


def test_a_tokenizer_with_its_own_bos_gets_nothing_more() -> None:
    tok = metaspace_tokenizer()  # puts <s> before every text, like Llama's
    for setting in ("auto", "</s>", None):
        assert resolve_start_token(tok, setting) is None
        assert with_start_token(tok, setting) is tok
    assert start_token_tag(tok) == f"__start{tok.convert_tokens_to_ids('<s>')}"


def test_none_and_unknown_tokens() -> None:
    tok = byte_level_tokenizer()
    assert with_start_token(tok, None) is tok
    with pytest.raises(ValueError, match="not a token of the tokenizer's vocabulary.*--start-token none"):
        with_start_token(tok, "<s>")
    with pytest.raises(ValueError, match="empty string"):
        ROMEConfig(start_token="")


def _graph():
    tok = byte_level_tokenizer()
    model = tiny_gpt2(len(tok))
    return PatchableGraph(model, torch.randint(0, len(tok), (2, 6)), use_cache=False), tok


def _config(tmp_path, **settings) -> dict:
    return dict(n_samples=8, max_length=32, cache_dir=str(tmp_path), progress=False, steps=2, allow_unconverged=True,
                context_length_params=((5, 2),), **settings)


def test_rome_keys_statistics_and_templates_read_texts_after_the_start_token(tmp_path) -> None:
    pg, tok = _graph()
    corpus = Corpus(name="toy", texts=list(TOY_SENTENCES))
    node = "transformer.h_0.mlp.c_proj"
    rome = ROME(pg, tok, node, ROMEConfig(**_config(tmp_path)), corpus=corpus)
    plain = ROME(pg, tok, node, ROMEConfig(**_config(tmp_path, start_token=None)), corpus=corpus)
    assert rome.start_token == "<|endoftext|>" and plain.start_token is None and plain.tokenizer is tok
    # ROME's k* is the layer input at the subject's last token of the prefixed texts, not of the plain ones
    request = EditRequest("{} is in the river", "the old town", "Rome")
    edit = rome.compute(request)
    templates = rome.templates()
    key = compute_key(pg, rome.tokenizer, rome.layer, request.prompt, request.subject, templates)
    plain_key = compute_key(pg, tok, rome.layer, request.prompt, request.subject, templates)
    assert edit.info["key_norm"] == pytest.approx(float(key.norm()), rel=1e-6)
    assert abs(float(plain_key.norm()) - float(key.norm())) > 1e-3 * float(key.norm())
    # the edit records the token, so whoever applies it can prompt the model the same way
    assert edit.info["start_token"] == "<|endoftext|>"
    assert plain.compute(request).info["start_token"] is None
    # statistics and context prefixes are cached apart, so neither setting reads the other's files
    rome.statistics(), plain.statistics(), plain.templates()
    moments = sorted(p.name for p in tmp_path.rglob("*.safetensors"))
    assert len(moments) == 2 and sum("__start" in name for name in moments) == 1
    assert not torch.allclose(rome.statistics().matrix, plain.statistics().matrix)
    assert len(list(tmp_path.rglob("context_templates_*__start*.json"))) == 1
    assert len(list(tmp_path.rglob("context_templates_*.json"))) == 2


def test_memit_and_alphaedit_read_after_the_start_token_by_default(tmp_path) -> None:
    pg, tok = _graph()
    assert MEMIT(pg, tok, ["transformer.h_0.mlp.c_proj"],
                 MEMITConfig(**_config(tmp_path))).start_token == "<|endoftext|>"
    alpha = AlphaEdit(pg, tok, ["transformer.h_0.mlp.c_proj"], AlphaEditConfig(**_config(tmp_path)))
    assert alpha.start_token == "<|endoftext|>" and alpha.tokenizer is not tok
    assert not alpha.config.subject_first_key and alpha.config.early_stop_loss == 0.15  # AlphaEdit's own defaults
    alpha = AlphaEdit(pg, tok, ["transformer.h_0.mlp.c_proj"], AlphaEditConfig(**_config(tmp_path, start_token=None)))
    assert alpha.start_token is None and alpha.tokenizer is tok
    assert MEMIT(pg, tok, ["transformer.h_0.mlp.c_proj"], MEMITConfig(**_config(tmp_path, start_token=None))
                 ).tokenizer is tok


def test_eval_edit_scores_with_the_start_token_and_records_it(tmp_path) -> None:
    from recipes.cli import main

    tok = byte_level_tokenizer()
    cases = [{"case_id": 0, "requested_rewrite": {"prompt": "The river flows into the sea near {}",
                                                  "subject": "the old town", "target_new": {"str": "Rome"},
                                                  "target_true": {"str": "Paris"}},
              "paraphrase_prompts": ["I think the bridge is in the old town"],
              "neighborhood_prompts": ["The capital of France is"]}]
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    save = tmp_path / "model"
    tiny_gpt2(len(tok)).save_pretrained(save)
    tok.save_pretrained(save)
    common = ["eval-edit", "--method", "rome", "--model", str(save), "--node", "transformer.h_0.mlp.c_proj",
              "--cases", str(tmp_path / "cases.json"), "--n-samples", "8", "--steps", "2", "--cache-dir",
              str(tmp_path / "stats"), "--device", "cpu", "--quiet"]
    assert main([*common, "--out", str(tmp_path / "auto.json")]) == 0
    assert main([*common, "--start-token", "none", "--out", str(tmp_path / "none.json")]) == 0
    auto, none = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("auto", "none"))
    assert auto["settings"]["start_token"] == "<|endoftext|>" and none["settings"]["start_token"] is None
    assert auto["config"]["start_token"] == "auto" and none["config"]["start_token"] is None
    # the unedited model is scored on other texts, so its log-probabilities differ
    assert auto["cases"][0]["logp"]["pre"] != none["cases"][0]["logp"]["pre"]
    assert main([*common, "--start-token", "<s>", "--out", str(tmp_path / "bad.json")]) == 2
    assert not (tmp_path / "bad.json").exists()
