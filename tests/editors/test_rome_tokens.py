"""Subject and target token positions under GPT-2 style (no BOS, "Ġ" spaces) and Llama style ("<s>", "▁") tokenizers."""

from __future__ import annotations

import pytest

from editors.errors import SubjectNotFoundError, TokenizationError
from editors.passes.tokens import encode_prompt_target, encode_subject_prompt, format_with_span
from gradpatch.model_io import right_pad
from gradpatch.testing import byte_level_tokenizer, metaspace_tokenizer


@pytest.fixture(scope="module", params=["byte_level", "metaspace"])
def tok(request):
    return byte_level_tokenizer() if request.param == "byte_level" else metaspace_tokenizer()


def _piece(tok, token_id: int) -> str:
    return tok.convert_ids_to_tokens(token_id).replace("Ġ", " ").replace("▁", " ")


@pytest.mark.parametrize("prefix", ["", "Because it rains. ", "The Tower of Paris. "])
def test_subject_last_token(tok, prefix: str) -> None:
    text, span = format_with_span("The {} is located in the city of", "Eiffel Tower", prefix)
    assert text[span[0] : span[1]] == "Eiffel Tower"
    enc = encode_subject_prompt(tok, text, span)
    # The subject's last token ends the word "Tower" and belongs to the subject, not to a prefix's "Tower".
    assert _piece(tok, enc.ids[enc.subject_last]).strip() in ("Tower", "er", "ower", "r", "wer")
    decoded_upto = tok.decode(enc.ids[: enc.subject_last + 1], skip_special_tokens=True)
    assert decoded_upto.endswith("Eiffel Tower")
    assert decoded_upto.count("Eiffel") == prefix.count("Eiffel") + 1


def test_subject_first_and_bos(tok) -> None:
    text, span = format_with_span("{} is located in", "Colosseum")
    enc = encode_subject_prompt(tok, text, span)
    assert tok.decode(enc.ids[: enc.subject_last + 1], skip_special_tokens=True).strip() == "Colosseum"
    has_bos = tok.bos_token_id is not None and enc.ids[0] == tok.bos_token_id
    assert has_bos == (tok.bos_token == "<s>")
    if has_bos:
        assert enc.subject_last >= 1  # never the BOS position


def test_target_tokens(tok) -> None:
    text, span = format_with_span("The capital of {} is", "France")
    enc = encode_prompt_target(tok, text, "Paris", subject_span=span)
    assert tok.decode(enc.ids[enc.target_start :]).strip() == "Paris"
    assert enc.n_target == len(enc.ids) - enc.target_start >= 1
    assert enc.subject_last < enc.target_start
    assert tok.decode(enc.ids[: enc.target_start], skip_special_tokens=True) == text


def test_errors_name_the_fix(tok) -> None:
    with pytest.raises(SubjectNotFoundError, match="exactly one"):
        format_with_span("The capital of France is", "France")
    with pytest.raises(SubjectNotFoundError, match="empty"):
        format_with_span("The capital of {} is", "")
    with pytest.raises(TokenizationError, match="empty"):
        encode_prompt_target(tok, "The capital of France is", "  ")


def test_right_pad() -> None:
    ids, lengths = right_pad([[5, 6, 7], [8]], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [8, 0, 0]] and lengths.tolist() == [3, 1]
    with pytest.raises(ValueError):
        right_pad([], 0)
