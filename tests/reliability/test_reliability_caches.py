"""Caches (second-moment statistics, context templates): a damaged file is recomputed with a warning naming it."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from editors import Corpus, layer_second_moment
from editors.errors import CacheRecomputedWarning
from editors.statistics.keys import load_or_generate_prefixes
from gradpatch.testing import TOY_SENTENCES, byte_level_tokenizer, tiny_llama

NODE = "model.layers_1.mlp.down_proj"
CORPUS = Corpus(name="toy", texts=list(TOY_SENTENCES) * 2)


@pytest.fixture(scope="module")
def setup():
    from gradpatch import PatchableGraph

    tok = byte_level_tokenizer()
    model = tiny_llama(len(tok))
    return PatchableGraph(model, torch.randint(0, len(tok), (2, 6)), use_cache=False), tok


def _stats(setup, cache: Path, dtype: torch.dtype = torch.float64):
    pg, tok = setup
    return layer_second_moment(pg, tok, NODE, CORPUS, n_samples=8, batch_size=4, cache_dir=cache, progress=False,
                               accumulate_dtype=dtype)


def _resave(path: Path, change) -> None:
    """Rewrite a cache file with ``change(matrix, metadata)`` applied (a consistent file with a damaged matrix)."""
    with safe_open(str(path), framework="pt") as handle:
        matrix, meta = handle.get_tensor("second_moment"), dict(handle.metadata())
    matrix = change(matrix, meta)
    save_file({"second_moment": matrix.contiguous()}, str(path), metadata=meta)


def _nan(m: torch.Tensor, meta: dict) -> torch.Tensor:
    m = m.clone()
    m[1, 2] = m[2, 1] = float("nan")
    return m


def _asymmetric(m: torch.Tensor, meta: dict) -> torch.Tensor:
    m = m.clone()
    m[0, 5] += 1.0
    return m


DAMAGES = {
    "empty": lambda p: p.write_bytes(b""),
    "truncated": lambda p: p.write_bytes(p.read_bytes()[: p.stat().st_size // 2]),
    "nan": lambda p: _resave(p, _nan),
    "asymmetric": lambda p: _resave(p, _asymmetric),
    "float32 under a float64 name": lambda p: _resave(p, lambda m, meta: m.float()),
    "wrong shape": lambda p: _resave(p, lambda m, meta: m[:-1, :-1]),
    "other layer": lambda p: _resave(p, lambda m, meta: [meta.update(node="model.layers_0.mlp.down_proj.input"), m][1]),
    "no token count": lambda p: _resave(p, lambda m, meta: [meta.pop("n_tokens"), m][1]),
}


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_a_damaged_statistics_cache_is_recomputed(damage: str, setup, tmp_path) -> None:
    first = _stats(setup, tmp_path)
    [path] = tmp_path.rglob("*.safetensors")
    DAMAGES[damage](path)
    with pytest.warns(CacheRecomputedWarning, match="recomputing") as record:
        again = _stats(setup, tmp_path)
    assert str(path) in str(record[0].message)
    assert torch.equal(again.matrix, first.matrix) and again.n_tokens == first.n_tokens
    with warnings.catch_warnings():
        warnings.simplefilter("error", CacheRecomputedWarning)  # the file was replaced by a good one
        assert torch.equal(_stats(setup, tmp_path).matrix, first.matrix)
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary file left


def test_float32_statistics_are_stored_in_the_dtype_their_name_gives(setup, tmp_path) -> None:
    first = _stats(setup, tmp_path, torch.float32)
    [path] = tmp_path.rglob("*.safetensors")
    assert path.name.endswith("__float32.safetensors")
    with safe_open(str(path), framework="pt") as handle:
        assert handle.get_tensor("second_moment").dtype == torch.float32
    with warnings.catch_warnings():
        warnings.simplefilter("error", CacheRecomputedWarning)
        again = _stats(setup, tmp_path, torch.float32)
    assert again.matrix.dtype == torch.float64 and torch.equal(again.matrix, first.matrix)


@pytest.mark.parametrize("content", ['{"prefixes": ["", "The', '{"prefixes": ["", "one. "]}', '{"other": 1}', "[]"])
def test_a_damaged_context_template_cache_is_regenerated(content: str, setup, tmp_path) -> None:
    pg, tok = setup
    params = ((3, 2),)
    templates = load_or_generate_prefixes(pg, tok, tmp_path, "fp", length_params=params)
    [path] = tmp_path.rglob("context_templates_*.json")
    path.write_text(content)
    with pytest.warns(CacheRecomputedWarning, match="context template cache") as record:
        again = load_or_generate_prefixes(pg, tok, tmp_path, "fp", length_params=params)
    assert str(path) in str(record[0].message)
    assert again == templates and len(again) == 3
    assert json.loads(path.read_text())["prefixes"] == list(templates.prefixes)
