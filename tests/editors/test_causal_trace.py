"""Causal tracing (editors.causal_trace): shapes, restoration sanity properties, outputs, CLI; real model if slow."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from editors.causal_trace import (
    GPT2_PATHS,
    LLAMA_PATHS,
    ModelPaths,
    TraceError,
    causal_trace,
    corpus_embedding_std,
    detect_model_paths,
    embedding_matrix_std,
    layer_window,
    save_trace,
    subject_token_range,
)
from editors.errors import SubjectNotFoundError
from gradpatch import AddPatch, PatchableGraph, ProbePatch, ReplacePatch
from gradpatch.testing import tiny_gpt2, tiny_llama
from recipes.reports.trace_tensorboard import log_trace_to_tensorboard

WORDS = "The Eiffel Tower is located in the city of Paris Rome Colosseum a famous landmark".split()


def word_tokenizer() -> Any:
    """A fast word-level tokenizer over :data:`WORDS` (ids 1.., 0 = [UNK]); whitespace-separated words."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")


class SlowWordTokenizer:
    """The same word tokenizer without offsets (as slow tokenizers): exercises the fallback subject search."""

    all_special_ids: list[int] = []

    def __init__(self) -> None:
        self.vocab = {w: i + 1 for i, w in enumerate(WORDS)}

    def __call__(self, text: str, return_offsets_mapping: bool = False) -> dict[str, list[int]]:
        if return_offsets_mapping:
            raise NotImplementedError("no offsets")
        return {"input_ids": [self.vocab.get(w, 0) for w in text.split()]}

    def decode(self, ids: list[int]) -> str:
        inverse = {i: w for w, i in self.vocab.items()}
        return " ".join(inverse.get(i, "[UNK]") for i in ids)


@pytest.fixture(scope="module")
def llama3() -> nn.Module:
    return tiny_llama(100, hidden=64, intermediate=128, layers=3, init_std=0.02, max_position_embeddings=128,
                      pad_token_id=None, bos_token_id=1, eos_token_id=2)


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return word_tokenizer()


@pytest.fixture(scope="module")
def pg(llama3: nn.Module, tokenizer: Any) -> PatchableGraph:
    ids = tokenizer("The Eiffel Tower is located in the city of", return_tensors="pt").input_ids
    return PatchableGraph(llama3, ids.expand(2, -1), use_cache=False)


PROMPT = "{} is located in the city of"
SUBJECT = "The Eiffel Tower"


@pytest.fixture(scope="module")
def result(pg: PatchableGraph, tokenizer: Any):
    return causal_trace(pg, tokenizer, PROMPT, SUBJECT, samples=3, batch_size=16)


def test_grid_shapes_and_metadata(result) -> None:
    assert result.tokens == "The Eiffel Tower is located in the city of".split()
    assert result.subject_range == (0, 3)
    assert result.num_layers == 3
    assert set(result.kinds) == {"hidden", "mlp", "attn"}
    for kind, trace in result.kinds.items():
        assert trace.scores.shape == (3, 9)
        assert torch.isfinite(trace.scores).all()
        assert ((trace.scores >= 0) & (trace.scores <= 1)).all()
    assert result.kinds["hidden"].window == 1 and result.kinds["mlp"].window == 10
    assert result.kinds["mlp"].node_pattern == "model.layers_{}.mlp.output"
    assert result.noise_std_source == "embedding_matrix"
    assert 0 < result.clean_prob <= 1 and 0 < result.corrupted_prob <= 1


def test_restoring_the_last_hidden_state_gives_back_the_clean_probability(result) -> None:
    # The last layer's hidden state at the last position determines the output: restoring it is a full repair.
    last = result.kinds["hidden"].scores[-1, -1]
    torch.testing.assert_close(last, torch.tensor(result.clean_prob), rtol=1e-5, atol=1e-7)


def test_restoring_each_position_of_the_last_layer(result) -> None:
    """In the last layer, only the last position feeds the output: it restores the clean probability exactly,
    every other position leaves the corrupted baseline exactly."""
    last_row = result.kinds["hidden"].scores[-1]
    torch.testing.assert_close(last_row[-1], torch.tensor(result.clean_prob), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(last_row[:-1], torch.full_like(last_row[:-1], result.corrupted_prob),
                               rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize(("kind", "layer", "token"), [("hidden", 0, 2), ("hidden", 1, 5), ("mlp", 1, 1),
                                                     ("attn", 2, 8), ("mlp", 0, 8)])
def test_cells_match_a_cell_by_cell_reference(pg: PatchableGraph, tokenizer: Any, llama3: nn.Module, result,
                                              kind: str, layer: int, token: int) -> None:
    """Recompute single cells the plain way: all samples in one batch, noise on the subject, one token restored."""
    ids = tokenizer("The Eiffel Tower is located in the city of", return_tensors="pt").input_ids
    node = {"hidden": "model.layers_{}.output", "mlp": "model.layers_{}.mlp.output",
            "attn": "model.layers_{}.self_attn.output|sub_0"}[kind]
    layers = [layer] if kind == "hidden" else list(range(3))  # window 10 covers all 3 layers
    probes = {node.format(i): ProbePatch() for i in layers}
    with torch.no_grad():
        with pg.patch(probes):
            pg(ids.expand(2, -1), use_cache=False)
        scale = 3.0 * float(llama3.model.embed_tokens.weight.std())
        noise = torch.randn(3, 3, 64, generator=torch.Generator().manual_seed(1)) * scale
        patches: dict[str, Any] = {"model.embed_tokens.output": AddPatch(value=noise, slice=(slice(None), slice(0, 3)))}
        for path, probe in probes.items():
            patches[path] = ReplacePatch(value=probe.activation[0, token], slice=(slice(None), token))
        with pg.patch(patches):
            logits = pg(ids.expand(3, -1), use_cache=False).logits[:, -1]
    expected = torch.softmax(logits, dim=-1)[:, result.answer_id].mean()
    torch.testing.assert_close(result.kinds[kind].scores[layer, token], expected, rtol=1e-5, atol=1e-7)


def test_without_the_logits_cut(pg: PatchableGraph, tokenizer: Any, result) -> None:
    full = causal_trace(pg, tokenizer, PROMPT, SUBJECT, samples=3, batch_size=64,
                        paths=ModelPaths(logits_input=None))
    for kind in result.kinds:
        torch.testing.assert_close(full.kinds[kind].scores, result.kinds[kind].scores, rtol=1e-5, atol=1e-7)


def test_zero_noise_restores_the_clean_probability_everywhere(pg: PatchableGraph, tokenizer: Any) -> None:
    res = causal_trace(pg, tokenizer, PROMPT, SUBJECT, samples=2, noise_level=0.0, batch_size=7)
    clean = torch.tensor(res.clean_prob)
    torch.testing.assert_close(torch.tensor(res.corrupted_prob), clean, rtol=1e-5, atol=1e-7)
    for trace in res.kinds.values():
        torch.testing.assert_close(trace.scores, clean.expand_as(trace.scores), rtol=1e-5, atol=1e-7)


def test_causal_shortcut_matches_the_full_computation(pg: PatchableGraph, tokenizer: Any) -> None:
    # Subject in the middle: positions before it are unaffected by the noise in a causal model.
    prompt = "The city of {} is a famous landmark"
    fast = causal_trace(pg, tokenizer, prompt, "Paris", samples=2, kinds=["hidden", "mlp"], batch_size=5)
    full = causal_trace(pg, tokenizer, prompt, "Paris", samples=2, kinds=["hidden", "mlp"], causal=False)
    assert fast.subject_range == (3, 4)
    for kind in fast.kinds:
        torch.testing.assert_close(fast.kinds[kind].scores, full.kinds[kind].scores, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(fast.kinds[kind].scores[:, :3],
                                   torch.full((3, 3), fast.corrupted_prob), rtol=1e-5, atol=1e-7)


def test_batching_does_not_change_the_result(pg: PatchableGraph, tokenizer: Any, result) -> None:
    other = causal_trace(pg, tokenizer, PROMPT, SUBJECT, samples=3, batch_size=5)  # last chunk: odd sizes
    for kind in result.kinds:
        torch.testing.assert_close(other.kinds[kind].scores, result.kinds[kind].scores, rtol=1e-4, atol=1e-6)


def test_single_sample_single_row_chunks(pg: PatchableGraph, tokenizer: Any) -> None:
    # 1 sample, 3 layers x 9 tokens = 27 rows; batch 2 leaves a 1-row chunk (run padded to 2 rows).
    res = causal_trace(pg, tokenizer, PROMPT, SUBJECT, samples=1, kinds=["hidden"], batch_size=2)
    torch.testing.assert_close(res.kinds["hidden"].scores[-1, -1], torch.tensor(res.clean_prob),
                               rtol=1e-5, atol=1e-7)


def test_given_answer_and_noise_std(pg: PatchableGraph, tokenizer: Any) -> None:
    res = causal_trace(pg, tokenizer, PROMPT, SUBJECT, answer="Rome", samples=2, kinds=["hidden"], noise_std=0.5)
    assert res.answer == "Rome" and res.answer_id == tokenizer.convert_tokens_to_ids("Rome")
    assert res.noise_std == 0.5 and res.noise_std_source == "given"
    res_id = causal_trace(pg, tokenizer, PROMPT, SUBJECT, answer=res.answer_id, samples=2, kinds=["hidden"],
                          noise_std=0.5)
    torch.testing.assert_close(res_id.kinds["hidden"].scores, res.kinds["hidden"].scores)


def test_same_seed_same_trace_other_seed_other_noise(pg: PatchableGraph, tokenizer: Any) -> None:
    a = causal_trace(pg, tokenizer, PROMPT, SUBJECT, samples=2, kinds=["hidden"], seed=3)
    b = causal_trace(pg, tokenizer, PROMPT, SUBJECT, samples=2, kinds=["hidden"], seed=3)
    c = causal_trace(pg, tokenizer, PROMPT, SUBJECT, samples=2, kinds=["hidden"], seed=4)
    torch.testing.assert_close(a.kinds["hidden"].scores, b.kinds["hidden"].scores)
    assert a.corrupted_prob != c.corrupted_prob


def test_errors_name_the_fix(pg: PatchableGraph, tokenizer: Any) -> None:
    with pytest.raises(SubjectNotFoundError, match="does not occur"):
        causal_trace(pg, tokenizer, "The Colosseum is in the city of", "The Eiffel Tower")
    with pytest.raises(SubjectNotFoundError, match="exactly one"):
        causal_trace(pg, tokenizer, "{} is in {}", "Paris")
    with pytest.raises(TraceError, match="choose among"):
        causal_trace(pg, tokenizer, PROMPT, SUBJECT, kinds=["mlp", "resid"])
    with pytest.raises(TraceError, match="paths=ModelPaths"):
        causal_trace(pg, tokenizer, PROMPT, SUBJECT, paths=GPT2_PATHS)
    with pytest.raises(TraceError, match="not a tensor"):
        causal_trace(pg, tokenizer, PROMPT, SUBJECT, paths=ModelPaths(attn="self_attn.output"), kinds=["attn"])
    with pytest.raises(TraceError, match="at least 1"):
        causal_trace(pg, tokenizer, PROMPT, SUBJECT, windows={"mlp": 0})
    with pytest.raises(TraceError, match="at least 1"):
        causal_trace(pg, tokenizer, PROMPT, SUBJECT, samples=0)
    pg.train()
    try:
        with pytest.raises(TraceError, match=r"pg\.eval\(\)"):
            causal_trace(pg, tokenizer, PROMPT, SUBJECT)
    finally:
        pg.eval()


def test_config_and_keyword_options_agree(pg: PatchableGraph, tokenizer: Any, result) -> None:
    from editors.causal_trace import TraceConfig

    calls: list[tuple[int, int]] = []
    configured = causal_trace(pg, tokenizer, PROMPT, SUBJECT, config=TraceConfig(samples=3, batch_size=16),
                              progress=lambda done, total: calls.append((done, total)))
    for kind in result.kinds:
        torch.testing.assert_close(configured.kinds[kind].scores, result.kinds[kind].scores)
    rows = 3 * 3 * 9 * 3  # kinds x layers x tokens x samples (the subject starts at token 0)
    assert calls[-1] == (rows, rows) and [done for done, _ in calls] == sorted(done for done, _ in calls)
    overridden = causal_trace(pg, tokenizer, PROMPT, SUBJECT, config=TraceConfig(samples=3), kinds=["hidden"],
                              batch_size=16)
    torch.testing.assert_close(overridden.kinds["hidden"].scores, result.kinds["hidden"].scores)
    with pytest.raises(TraceError, match="fields of TraceConfig"):
        causal_trace(pg, tokenizer, PROMPT, SUBJECT, sample=3)


def test_subject_given_inside_the_full_prompt(pg: PatchableGraph, tokenizer: Any) -> None:
    res = causal_trace(pg, tokenizer, "The Eiffel Tower is located in the city of", "Eiffel Tower",
                       samples=1, kinds=["hidden"])
    assert res.subject_range == (1, 3)


def test_subject_token_range_slow_tokenizer_fallback(tokenizer: Any) -> None:
    text = "The city of Paris is a famous landmark"
    span = (text.index("Paris"), text.index("Paris") + 5)
    fast = subject_token_range(tokenizer, text, span)
    slow = subject_token_range(SlowWordTokenizer(), text, span)
    assert fast == slow
    assert fast[1] == (3, 4)


def test_layer_window_follows_the_paper() -> None:
    assert list(layer_window(12, 10, 30)) == list(range(7, 17))
    assert list(layer_window(0, 10, 30)) == list(range(0, 5))
    assert list(layer_window(29, 10, 30)) == list(range(24, 30))
    assert list(layer_window(4, 1, 30)) == [4]
    with pytest.raises(TraceError):
        layer_window(4, 0, 30)


def test_noise_scale_helpers(pg: PatchableGraph, tokenizer: Any, llama3: nn.Module) -> None:
    assert detect_model_paths(pg) == LLAMA_PATHS
    std = embedding_matrix_std(pg)
    assert std == pytest.approx(float(llama3.model.embed_tokens.weight.detach().std()))
    corpus = corpus_embedding_std(pg, tokenizer, ["The Eiffel Tower", "Paris"])
    rows = llama3.model.embed_tokens.weight.detach()[torch.tensor([1, 2, 3, 10])]
    assert corpus == pytest.approx(float(rows.std()), rel=1e-5)


def test_noise_scale_without_a_weight_matrix_names_the_fix(tokenizer: Any) -> None:
    """With the paths detected (``paths=None``), an embedding without a 2-D weight raises TraceError naming it."""
    model = tiny_llama(100, hidden=64, intermediate=128, layers=1)
    ids = tokenizer("The Eiffel Tower is located in the city of", return_tensors="pt").input_ids
    graph = PatchableGraph(model, ids.expand(2, -1), use_cache=False)
    model.model.embed_tokens.weight = nn.Parameter(torch.ones(64))
    with pytest.raises(TraceError, match="'model.embed_tokens' has no 2-D weight matrix: pass noise_std="):
        embedding_matrix_std(graph)


def test_gpt2_paths(tokenizer: Any) -> None:
    model = tiny_gpt2(100, hidden=64, init_std=0.02, n_positions=128)
    ids = tokenizer("The Eiffel Tower is located in the city of", return_tensors="pt").input_ids
    gpg = PatchableGraph(model, ids.expand(2, -1), use_cache=False)
    assert detect_model_paths(gpg) == GPT2_PATHS
    res = causal_trace(gpg, tokenizer, PROMPT, SUBJECT, samples=2)
    assert res.kinds["attn"].scores.shape == (2, 9)
    torch.testing.assert_close(res.kinds["hidden"].scores[-1, -1], torch.tensor(res.clean_prob),
                               rtol=1e-5, atol=1e-7)


def test_json_and_png_outputs(result, tmp_path: Path) -> None:
    written = save_trace(result, tmp_path / "out", model_name="tiny-llama")
    data = json.loads((tmp_path / "out" / "trace.json").read_text())
    assert data["clean_prob"] == result.clean_prob and data["corrupted_prob"] == result.corrupted_prob
    assert data["noise"]["std_source"] == "embedding_matrix" and data["noise"]["samples"] == 3
    assert len(data["kinds"]["mlp"]["scores"]) == 3 and len(data["kinds"]["mlp"]["scores"][0]) == 9
    from PIL import Image

    for kind in ("hidden", "mlp", "attn"):
        png = tmp_path / "out" / f"trace_{kind}.png"
        assert written[kind] == png
        with Image.open(png) as image:
            image.verify()
        with Image.open(png) as image:
            assert image.format == "PNG" and image.size[0] > 100 and image.size[1] > 100


def test_tensorboard_images(result, tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tags = log_trace_to_tensorboard(result, str(tmp_path / "tb"), tag="trace")
    assert tags == ["trace/hidden", "trace/mlp", "trace/attn"]
    acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={"images": 0})
    acc.Reload()
    assert set(acc.Tags()["images"]) == {"trace/hidden", "trace/mlp", "trace/attn"}
    assert {"trace/clean_prob", "trace/corrupted_prob"} <= set(acc.Tags()["scalars"])
    assert acc.Images("trace/mlp")[0].encoded_image_string[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_trace(llama3: nn.Module, tokenizer: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from recipes.cli import main

    model_dir = tmp_path / "model"
    llama3.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    status = main(["trace", "--model", str(model_dir), "--subject", SUBJECT, "--prompt", PROMPT,
                   "--out", str(tmp_path / "trace"), "--samples", "2", "--kinds", "hidden,mlp",
                   "--logdir", str(tmp_path / "tb")])
    assert status == 0
    out = capsys.readouterr().out
    assert str(tmp_path / "trace" / "trace.json") in out
    assert (tmp_path / "trace" / "trace_hidden.png").exists() and (tmp_path / "trace" / "trace_mlp.png").exists()
    assert not (tmp_path / "trace" / "trace_attn.png").exists()
    assert any((tmp_path / "tb").iterdir())


def test_cli_trace_reports_a_missing_subject(llama3: nn.Module, tokenizer: Any, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    from recipes.cli import main

    model_dir = tmp_path / "model"
    llama3.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    status = main(["trace", "--model", str(model_dir), "--subject", "Big Ben", "--prompt",
                   "The Eiffel Tower is located in the city of", "--out", str(tmp_path / "trace")])
    assert status == 2
    assert "does not occur" in capsys.readouterr().err


@pytest.mark.slow
def test_trace_smollm2_eiffel_tower(smollm2: tuple[nn.Module, Any], tmp_path: Path) -> None:
    model, tok = smollm2
    torch.set_num_threads(2)
    ids = tok("The Eiffel Tower is located in the city of", return_tensors="pt").input_ids
    spg = PatchableGraph(model, ids.expand(2, -1), use_cache=False)
    res = causal_trace(spg, tok, PROMPT, SUBJECT, kinds=["hidden"], samples=3)  # mlp/attn, 10 samples: 7× the time
    assert res.answer == " Paris"
    assert res.corrupted_prob < 0.5 * res.clean_prob
    recovered = (max(float(t.scores.max()) for t in res.kinds.values()) - res.corrupted_prob) / (
        res.clean_prob - res.corrupted_prob)
    assert recovered > 0.8
    # restoring a subject token's hidden state in the first half of the layers recovers much of the answer
    s0, s1 = res.subject_range
    early_subject = float(res.kinds["hidden"].scores[: res.num_layers // 2, s0:s1].max())
    assert early_subject > res.corrupted_prob + 0.3 * (res.clean_prob - res.corrupted_prob)
    save_trace(res, tmp_path, model_name="SmolLM2-135M-Instruct")
    assert (tmp_path / "trace_hidden.png").exists()
