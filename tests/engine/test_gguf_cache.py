"""The converted copy of the embedded GGUF model: the same model and tokenizer, written once, never half-written."""

from __future__ import annotations

import os
import types
from pathlib import Path

import pytest
import torch

from gradpatch.files.gguf_cache import COMPLETE_RECORD, converted_gguf_folder

FAKE_TRANSFORMERS = types.SimpleNamespace(__version__="9.9.9")  # only its version names the folder


def _gguf(tmp_path: Path) -> Path:
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF" + bytes(60))
    return path


def _writer(calls: list[Path]):
    def convert(gguf_path: Path, transformers: object, staging: Path) -> None:
        calls.append(staging)
        (staging / "model.safetensors").write_bytes(gguf_path.read_bytes())
        (staging / COMPLETE_RECORD).write_text("{}")
    return convert


def test_converted_once_per_file_and_converter(tmp_path) -> None:
    gguf, calls = _gguf(tmp_path), []
    folder = converted_gguf_folder(gguf, FAKE_TRANSFORMERS, tmp_path / "cache", convert=_writer(calls))
    stat = gguf.stat()
    assert folder.name == f"model-{stat.st_size}-{stat.st_mtime_ns}-transformers9.9.9" and len(calls) == 1
    assert (folder / "model.safetensors").read_bytes() == gguf.read_bytes()
    assert converted_gguf_folder(gguf, FAKE_TRANSFORMERS, tmp_path / "cache", convert=_writer(calls)) == folder
    assert len(calls) == 1  # read from the cache, not converted again
    os.utime(gguf, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # the file changed: a folder of its own
    other = converted_gguf_folder(gguf, FAKE_TRANSFORMERS, tmp_path / "cache", convert=_writer(calls))
    newer = converted_gguf_folder(gguf, types.SimpleNamespace(__version__="10.0"), tmp_path / "cache",
                                  convert=_writer(calls))
    assert len({folder, other, newer}) == 3 and len(calls) == 3
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == sorted(p.name for p in (folder, other, newer))


def test_a_failed_conversion_leaves_nothing_and_a_finished_one_by_another_process_wins(tmp_path) -> None:
    gguf, cache = _gguf(tmp_path), tmp_path / "cache"

    def fails(gguf_path: Path, transformers: object, staging: Path) -> None:
        (staging / "model.safetensors").write_bytes(b"half")
        raise RuntimeError("killed while writing")

    with pytest.raises(RuntimeError, match="killed while writing"):
        converted_gguf_folder(gguf, FAKE_TRANSFORMERS, cache, convert=fails)
    assert list(cache.iterdir()) == []  # neither the folder nor the half-written staging copy

    winner: list[Path] = []

    def raced(gguf_path: Path, transformers: object, staging: Path) -> None:
        # another process finishes the same folder while this one converts
        winner.append(converted_gguf_folder(gguf_path, transformers, cache, convert=_writer([])))
        (staging / COMPLETE_RECORD).write_text('{"mine": true}')

    folder = converted_gguf_folder(gguf, FAKE_TRANSFORMERS, cache, convert=raced)
    assert folder == winner[0] and (folder / "model.safetensors").exists()  # the first complete copy kept
    assert [p.name for p in cache.iterdir()] == [folder.name]  # this process's copy removed


def test_an_unwritable_cache_names_the_variable(tmp_path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(OSError, match="GRADPATCH_MODEL_CACHE"):
        converted_gguf_folder(_gguf(tmp_path), FAKE_TRANSFORMERS, blocker / "cache", convert=_writer([]))


@pytest.mark.slow
def test_the_cached_embedded_model_is_the_gguf_model(smollm2) -> None:
    from gradpatch.files.loaders import load_embedded_model

    cached, cached_tok = smollm2  # the session's model: loaded through the cache
    direct, direct_tok = load_embedded_model(cache=False)
    got, expected = cached.state_dict(), direct.state_dict()
    assert set(got) == set(expected) and all(torch.equal(got[k], expected[k]) for k in expected)
    assert cached.lm_head.weight.data_ptr() == cached.model.embed_tokens.weight.data_ptr()  # still tied
    assert "quantization_config" not in cached.config.to_dict()  # a plain float32 model
    assert cached.generation_config.to_dict() == direct.generation_config.to_dict()
    for text in ("The Eiffel Tower is in", "<|im_start|>user\nBağcılar<|im_end|>", " Paris\n\nRome"):
        assert cached_tok(text).input_ids == direct_tok(text).input_ids
    messages = [{"role": "user", "content": "Where is the Eiffel Tower?"}]
    assert cached_tok.apply_chat_template(messages, tokenize=False) == direct_tok.apply_chat_template(messages,
                                                                                                     tokenize=False)
    assert (cached_tok.bos_token, cached_tok.eos_token, cached_tok.pad_token) == (
        direct_tok.bos_token, direct_tok.eos_token, direct_tok.pad_token)
    half, _ = load_embedded_model(dtype=torch.bfloat16)  # cached too: the float32 weights cast
    assert all(torch.equal(v, expected[k].to(torch.bfloat16)) for k, v in half.state_dict().items())
