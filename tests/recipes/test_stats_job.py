"""The second-moment statistics job (recipes.editing.stats_job, ``gradpatch stats``) in one process: equal to
``compute_second_moments``, read back by the editors, resumed after an interruption, and its bad inputs (a resume
file from another configuration, a damaged one, settings that cannot work). The 2-process gloo runs are in
tests/recipes/test_stats_job_ddp.py."""

from __future__ import annotations

import random
import warnings

import pytest
import torch
from lightning.pytorch import Callback
from safetensors import safe_open

from editors import Corpus, compute_second_moments, editable_graph, layer_second_moments, resolve_layer
from editors.passes import with_start_token
from gradpatch.files.loaders import load_model
from recipes import PartialSumsWarning, SecondMomentJob, StatisticsJobError, run_statistics_job
from recipes.editing.stats_partial import partial_file
from recipes.testing import WORDS, save_tiny_backbone, tiny_backbone

NODES = ["model.layers_0.mlp.down_proj", "model.layers_1.self_attn.o_proj"]
TRAINER = {"accelerator": "cpu", "devices": 1, "enable_progress_bar": False}


def word_corpus(n: int = 40, seed: int = 0) -> Corpus:
    rng = random.Random(seed)
    return Corpus(name="tiny-words", texts=[" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 30)))
                                            for _ in range(n)])


@pytest.fixture(scope="module")
def graph():
    model, tokenizer = tiny_backbone()
    return editable_graph(model, tokenizer), tokenizer


def job(graph, tmp_path, **options):
    pg, tokenizer = graph
    settings = {"n_samples": 40, "max_length": 16, "batch_size": 4, "checkpoint_every": 8, "cache_dir": tmp_path,
                **options}
    return SecondMomentJob(pg, tokenizer, NODES, word_corpus(), **settings)


class Interrupt(Callback):
    """Stops the pass with an exception once ``after`` documents of the shard are done (a checkpoint is taken at
    every 8)."""

    def __init__(self, after: int) -> None:
        self.after = after

    def on_predict_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        if pl_module.done >= self.after:
            raise RuntimeError("interrupted")


def test_job_equals_compute_second_moments_and_editors_read_its_files(graph, tmp_path):
    pg, tokenizer = graph
    moments = run_statistics_job(job(graph, tmp_path), **TRAINER)
    layers = [resolve_layer(pg, node) for node in NODES]
    reference, n_tokens, n_docs = compute_second_moments(pg, tokenizer, layers, word_corpus(), n_samples=40,
                                                         max_length=16, batch_size=4, progress=False)
    assert [m.n_tokens for m in moments] == [n_tokens] * 2 and moments[0].n_samples == n_docs == 40
    for moment, matrix in zip(moments, reference):
        assert moment.matrix.dtype == torch.float64 and moment.matrix.abs().max() > 0
        assert float((moment.matrix - matrix).abs().max() / matrix.abs().max()) <= 1e-6
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a recomputed cache file would warn
        cached = layer_second_moments(pg, tokenizer, NODES, word_corpus(), n_samples=40, max_length=16,
                                      cache_dir=tmp_path, progress=False)
    assert all(torch.equal(c.matrix, m.matrix) for c, m in zip(cached, moments))
    assert not partial_file(tmp_path / "partial", 0).exists()  # removed once the cache files are written


def test_interrupted_job_resumes_from_its_checkpoint_and_equals_an_uninterrupted_one(graph, tmp_path):
    uninterrupted = run_statistics_job(job(graph, tmp_path / "a"), **TRAINER)
    with pytest.raises(RuntimeError, match="interrupted"):
        run_statistics_job(job(graph, tmp_path / "b"), callbacks=[Interrupt(after=20)], **TRAINER)
    assert partial_file(tmp_path / "b" / "partial", 0).is_file()
    resumed_job = job(graph, tmp_path / "b")
    resumed = run_statistics_job(resumed_job, **TRAINER)
    assert resumed_job.partial is not None and resumed_job.partial.documents_done == 16  # the last checkpoint
    for a, b in zip(resumed, uninterrupted):
        assert a.n_tokens == b.n_tokens and a.n_samples == b.n_samples == 40
        assert float((a.matrix - b.matrix).abs().max() / b.matrix.abs().max()) <= 1e-12


def test_resume_file_from_another_configuration_is_refused_with_the_reason(graph, tmp_path):
    with pytest.raises(RuntimeError, match="interrupted"):
        run_statistics_job(job(graph, tmp_path), callbacks=[Interrupt(after=8)], **TRAINER)
    path = partial_file(tmp_path / "partial", 0)
    before = path.read_bytes()
    with pytest.raises(StatisticsJobError, match=r"max_length: 16 in the file, 12 in this job.*--restart"):
        run_statistics_job(job(graph, tmp_path, max_length=12), **TRAINER)
    assert path.read_bytes() == before  # refused, not overwritten
    restarted = job(graph, tmp_path, max_length=12, restart=True)
    run_statistics_job(restarted, **TRAINER)
    assert restarted.partial is None and restarted.results[0].n_samples == 40


def test_damaged_checkpoint_is_named_and_its_shard_recomputed(graph, tmp_path):
    reference = run_statistics_job(job(graph, tmp_path / "a"), **TRAINER)
    path = partial_file(tmp_path / "b" / "partial", 0)
    path.parent.mkdir(parents=True)
    path.write_bytes(b"\x00garbage, not safetensors")
    with pytest.warns(PartialSumsWarning, match=str(path).replace(".", r"\.") + " is unreadable"):
        damaged = job(graph, tmp_path / "b")
        moments = run_statistics_job(damaged, **TRAINER)
    assert damaged.partial is None
    assert all(torch.equal(a.matrix, b.matrix) for a, b in zip(moments, reference))


@pytest.mark.parametrize("options, message", [
    ({"n_samples": 0}, "n_samples must be a positive integer"),
    ({"checkpoint_every": -1}, "checkpoint_every must be a positive integer"),
])
def test_settings_that_cannot_work_are_refused_before_any_work(graph, tmp_path, options, message):
    with pytest.raises(StatisticsJobError, match=message):
        job(graph, tmp_path, **options)


def test_anonymous_corpus_and_distributed_sampler_are_refused(graph, tmp_path):
    pg, tokenizer = graph
    with pytest.raises(StatisticsJobError, match="no name"):
        SecondMomentJob(pg, tokenizer, NODES, corpus=["a city", "the tower"])  # type: ignore[arg-type]
    with pytest.raises(StatisticsJobError, match="would repeat documents"):
        run_statistics_job(job(graph, tmp_path), use_distributed_sampler=True, **TRAINER)


def test_gradpatch_stats_command_writes_the_cache_files(tmp_path, capsys):
    from recipes.cli import main

    model_dir = save_tiny_backbone(tmp_path / "model")
    corpus_file = tmp_path / "corpus.txt"
    corpus_file.write_text("\n\n".join(word_corpus().texts), encoding="utf-8")
    status = main(["stats", "--model", str(model_dir), "--nodes", NODES[0], "--docs", "30", "--max-length", "16",
                   "--corpus", str(corpus_file), "--out", str(tmp_path / "stats"), "--quiet"])
    assert status == 0
    printed = capsys.readouterr().out
    assert f"{NODES[0]}.input: 30 documents" in printed
    files = list((tmp_path / "stats").rglob("*.safetensors"))
    assert [f.name for f in files] == [f"{NODES[0]}.input__file-{printed.split('__file-')[1].split('__')[0]}"
                                       f"__n30__len16__float64.safetensors"]
    # with a start token the files are keyed apart, and an editor with that token reads them (no recomputation)
    assert main(["stats", "--model", str(model_dir), "--nodes", NODES[0], "--docs", "30", "--max-length", "16",
                 "--corpus", str(corpus_file), "--out", str(tmp_path / "stats"), "--quiet", "--start-token",
                 "<eos>"]) == 0
    capsys.readouterr()
    [started] = [f for f in (tmp_path / "stats").rglob("*.safetensors") if "__len16__start2__" in f.name]
    model, tokenizer = load_model(str(model_dir), device="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        [moment] = layer_second_moments(editable_graph(model, tokenizer), with_start_token(tokenizer, "<eos>"),
                                        NODES[:1], str(corpus_file), n_samples=30, max_length=16,
                                        cache_dir=tmp_path / "stats", progress=False, use_cache=True)
    with safe_open(str(started), framework="pt") as handle:
        assert torch.equal(moment.matrix, handle.get_tensor("second_moment"))
    assert main(["stats", "--model", str(model_dir), "--docs", "3"]) == 2  # --nodes needed with --model
    assert "--nodes is needed" in capsys.readouterr().err
    assert main(["stats", "--model", str(model_dir), "--nodes", "model.layers_0.mlp", "--docs", "3",
                 "--corpus", str(corpus_file), "--out", str(tmp_path / "stats")]) == 2  # not a linear layer
    assert "gradpatch stats: " in capsys.readouterr().err


@pytest.mark.cuda
def test_job_on_one_gpu_equals_the_cpu_job(tmp_path):
    model, tokenizer = tiny_backbone()
    gpu = run_statistics_job(SecondMomentJob(editable_graph(model, tokenizer), tokenizer, NODES, word_corpus(),
                                             n_samples=40, max_length=16, batch_size=4, cache_dir=tmp_path / "gpu"),
                             accelerator="gpu", devices=1, enable_progress_bar=False)
    model, tokenizer = tiny_backbone()
    cpu = run_statistics_job(SecondMomentJob(editable_graph(model, tokenizer), tokenizer, NODES, word_corpus(),
                                             n_samples=40, max_length=16, batch_size=4, cache_dir=tmp_path / "cpu"),
                             **TRAINER)
    for a, b in zip(gpu, cpu):
        assert a.matrix.device.type == "cpu" and a.n_tokens == b.n_tokens
        # float32 forward passes on two devices
        assert float((a.matrix - b.matrix).abs().max() / b.matrix.abs().max()) <= 1e-5
