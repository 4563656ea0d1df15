"""Training a dictionary in Lightning on the tiny Llama's streamed activations (recipes.dictionary): the loss falls,
decoder rows stay unit norm, the buffer fills before the first step and the dictionary is written at the end."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loops.optimization.automatic import Closure
from lightning.pytorch.trainer.connectors import data_connector
from torch.utils.data import DataLoader

from gradpatch.dictionaries import SparseAutoencoder, Transcoder, load_dictionary
from gradpatch.errors import NonFiniteError
from recipes.dictionary import ActivationBuffer, DictionaryDataModule, DictionaryModule, EndToEndDictionaryModule
from recipes.errors import RecipeConfigError

CHUNKS = torch.randint(3, 100, (48, 8), generator=torch.Generator().manual_seed(0))  # 48 sequences of 8 tokens


def _fit(module: DictionaryModule, root: Path, steps: int, term: str = "fvu") -> list[float]:
    """Fit for ``steps`` batches of 4 sequences; returns the loss term ``term`` of each optimizer step."""
    values: list[float] = []
    original = module.loss_terms

    def recording(batch: torch.Tensor) -> dict[str, torch.Tensor]:
        terms = original(batch)
        values.append(float(terms[term].detach()))
        return terms

    module.loss_terms = recording  # type: ignore[method-assign]
    trainer = Trainer(max_steps=steps, accelerator="cpu", logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(root))
    trainer.fit(module, DataLoader(CHUNKS, batch_size=4))
    return values


def test_topk_sae_trains_on_streamed_activations(llama_graph, tmp_path: Path) -> None:
    sae = SparseAutoencoder(64, 128, "topk", k=8, node="model.layers_0.output",
                            generator=torch.Generator().manual_seed(0))
    module = DictionaryModule(llama_graph, sae, buffer_rows=96, lr=1e-2, dead_after_tokens=64)
    fvus = _fit(module, tmp_path, steps=42)
    assert len(fvus) == 40  # the first two batches only filled the buffer (2 × 32 rows < 96)
    assert sum(fvus[-3:]) / 3 < 0.8 * sum(fvus[:3]) / 3
    assert torch.allclose(sae.W_dec.norm(dim=-1), torch.ones(128), atol=1e-5)
    saved = load_dictionary(tmp_path / "dictionary", model=llama_graph.wrapped_model)
    assert torch.equal(saved.W_enc, sae.W_enc.detach())


@pytest.mark.parametrize("activation", ["relu", "jumprelu", "batchtopk"])
def test_transcoders_train_with_each_sparsity_term(llama_graph, tmp_path: Path, activation: str) -> None:
    transcoder = Transcoder(64, 96, activation=activation, k=4 if activation == "batchtopk" else None,
                            input_node="model.layers_0.mlp.x", output_node="model.layers_0.mlp.output",
                            generator=torch.Generator().manual_seed(0))
    threshold = transcoder.threshold.detach().clone() if activation == "jumprelu" else None
    fvus = _fit(DictionaryModule(llama_graph, transcoder, buffer_rows=32, lr=1e-2, sparsity_coefficient=1e-2),
                tmp_path, steps=6)
    assert len(fvus) == 6 and all(torch.isfinite(torch.tensor(fvus)))
    if threshold is not None:  # the L0 penalty's straight-through gradient moved θ
        assert not torch.equal(transcoder.threshold.detach(), threshold)


def test_buffer_mixes_and_is_bounded() -> None:
    buffer = ActivationBuffer(6, torch.Generator().manual_seed(0))
    buffer.push(torch.arange(4.0)[:, None])
    assert not buffer.ready(4)
    buffer.push(torch.arange(4.0, 8.0)[:, None])
    assert buffer.ready(4)
    drawn = buffer.pop(4)
    assert len(buffer) == 4 and sorted(drawn.flatten().tolist() + buffer.rows.flatten().tolist()) == list(range(8))
    with pytest.raises(ValueError, match="fewer than"):
        buffer.pop(5)


def test_buffer_streams_within_its_bound() -> None:
    buffer = ActivationBuffer(16, torch.Generator().manual_seed(0))
    drawn: list[float] = []
    for step in range(50):  # 200 rows through a buffer of 16: one storage of 16 rows, reused
        buffer.push(torch.arange(4.0 * step, 4.0 * step + 4)[:, None])
        if step == 0:
            storage = buffer.storage
        assert buffer.storage is storage and storage.shape == (16, 1) and len(buffer) <= 16
        if buffer.ready(4):
            drawn += buffer.pop(4).flatten().tolist()
    assert len(buffer) == 12 and len(drawn) == 188
    assert sorted(drawn + buffer.rows.flatten().tolist()) == [float(i) for i in range(200)]  # each row out once
    assert drawn[:16] != sorted(drawn[:16])  # drawn at random, not in order
    with pytest.raises(ValueError, match="do not fit"):
        buffer.push(torch.zeros(4, 2))


def test_training_streams_within_the_buffer_bound(llama_graph, tmp_path: Path) -> None:
    sae = SparseAutoencoder(64, 128, "topk", k=8, node="model.layers_0.output",
                            generator=torch.Generator().manual_seed(0))
    module = DictionaryModule(llama_graph, sae, buffer_rows=64, lr=1e-2)
    held: list[int] = []
    storages: list[int] = []
    push = module.buffer.push

    def recording(rows: torch.Tensor) -> None:
        push(rows)
        held.append(len(module.buffer))
        storages.append(module.buffer.storage.data_ptr())

    module.buffer.push = recording  # type: ignore[method-assign]
    _fit(module, tmp_path, steps=12)  # 12 batches of 32 rows: 384 rows through a buffer of 64
    assert held == [32] + [64] * 11  # full from the second batch on, never more than buffer_rows
    assert len(set(storages)) == 1 and module.buffer.storage.shape == (64, 64)  # allocated once, never grown


@pytest.mark.parametrize("stop", ["max_epochs", "max_steps"])
def test_every_streamed_row_is_trained_on_once(llama_graph, tmp_path: Path, stop: str) -> None:
    """The buffer is drained in the run's last batches (whether max_epochs or max_steps ends it): the optimizer steps
    draw every row streamed, each once, and the buffer ends empty."""
    sae = SparseAutoencoder(64, 128, "topk", k=8, node="model.layers_0.output",
                            generator=torch.Generator().manual_seed(0))
    module = DictionaryModule(llama_graph, sae, buffer_rows=96, lr=1e-2)
    pushed, drawn = [], []
    push, pop = module.buffer.push, module.buffer.pop
    module.buffer.push = lambda rows: (pushed.append(rows.clone()), push(rows))[1]  # type: ignore[method-assign]
    module.buffer.pop = lambda count: drawn.append(pop(count)) or drawn[-1]  # type: ignore[method-assign]
    ends = {"max_epochs": 1} if stop == "max_epochs" else {"max_steps": 10, "max_epochs": 2}
    Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, default_root_dir=str(tmp_path), **ends).fit(
        module, DataLoader(CHUNKS, batch_size=4))  # 12 batches of 32 rows; the first two only fill the buffer
    rows = torch.cat(pushed)  # 12 batches, or 10 (Lightning counts the batches that only filled as steps)
    assert len(module.buffer) == 0 and [len(d) for d in drawn][:4] == [32] * 4 and len(drawn[-1]) > 32
    assert sorted(map(tuple, torch.cat(drawn).tolist())) == sorted(map(tuple, rows.tolist()))


def test_a_dictionary_without_nodes_is_refused(llama_graph) -> None:
    with pytest.raises(RecipeConfigError, match="names no node"):
        DictionaryModule(llama_graph, Transcoder(64, 32, activation="relu", input_node="model.layers_0.mlp.x"))


@pytest.mark.parametrize("activation", ["topk", "relu"])
def test_end_to_end_training_lowers_the_kl_of_the_spliced_model(llama_graph, tmp_path: Path, activation: str) -> None:
    sae = SparseAutoencoder(64, 128, activation, k=8 if activation == "topk" else None, node="model.layers_1.output",
                            generator=torch.Generator().manual_seed(0))
    module = EndToEndDictionaryModule(llama_graph, sae, lr=1e-2, sparsity_coefficient=1e-4)
    kls = _fit(module, tmp_path, steps=40, term="kl")
    assert len(kls) == 40 and sum(kls[-3:]) < 0.6 * sum(kls[:3])
    assert (tmp_path / "dictionary" / "dictionary.json").is_file()


def test_a_diverged_dictionary_stops_training_and_writes_nothing(llama_graph, tmp_path: Path) -> None:
    sae = SparseAutoencoder(64, 128, "topk", k=8, node="model.layers_0.output")
    with torch.no_grad():
        sae.b_enc[3] = float("nan")
    with pytest.raises(NonFiniteError, match=r"'fvu'.*non-finite at step 0.*no dictionary was written"):
        _fit(DictionaryModule(llama_graph, sae, buffer_rows=32), tmp_path, steps=4)
    assert not (tmp_path / "dictionary").exists()


def _sae(first: int = 0) -> SparseAutoencoder:
    return SparseAutoencoder(64, 128, "topk", k=8, node="model.layers_0.output", exclude_first_positions=first,
                             generator=torch.Generator().manual_seed(0))


def _chunks() -> DictionaryDataModule:
    """A :class:`DictionaryDataModule` holding :data:`CHUNKS` (48 chunks of 8 tokens, batches of 4), no corpus."""
    data = DictionaryDataModule(train_tokens=384, chunk_length=8, batch_size=4)
    data.chunks = CHUNKS
    return data


def _trainer(root: Path, **options: object) -> Trainer:
    settings = {"max_epochs": 1, "accelerator": "cpu", "logger": False, "enable_checkpointing": False,
                "enable_progress_bar": False, "enable_model_summary": False, "default_root_dir": str(root), **options}
    return Trainer(**settings)


def test_fit_hides_the_fill_steps_warning_without_leaving_a_filter(llama_graph, tmp_path: Path) -> None:
    """The steps that fill the buffer return ``None`` on purpose: Lightning's warning about it is hidden during
    those steps, and no filter is left in the process's ``warnings.filters`` (setup used to add one per call)."""
    Closure.warning_cache.clear()  # Lightning warns once per process: forget earlier tests' runs
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fvus = _fit(DictionaryModule(llama_graph, _sae(), buffer_rows=96, lr=1e-2), tmp_path, steps=4)
        left = [entry for entry in warnings.filters if entry[1] is not None and "training_step" in entry[1].pattern]
    assert len(fvus) == 2 and not left
    assert not [w for w in caught if "returned `None`" in str(w.message)]


@pytest.mark.parametrize("case", ["buffer", "positions"])
def test_a_run_whose_buffer_never_fills_is_refused_before_it_starts(llama_graph, tmp_path: Path, case: str) -> None:
    """2 epochs of 48 chunks of 8 tokens push 768 rows, fewer than a buffer of 4096 (or none when the first 8
    positions are left out): the buffer would never fill and no optimizer step would run."""
    module = (DictionaryModule(llama_graph, _sae(), buffer_rows=4096) if case == "buffer" else
              DictionaryModule(llama_graph, _sae(first=8), buffer_rows=32))
    expected = {"buffer": r"768 activation rows .* buffer_rows=4096.* --data.train_tokens to at least 2048 .*"
                          r"--model.buffer_rows",
                "positions": r"chunk_length=8 .* exclude_first_positions=8.* --data.chunk_length"}[case]
    with pytest.raises(RecipeConfigError, match=expected):
        _trainer(tmp_path, max_epochs=2).fit(module, datamodule=_chunks())
    assert module.global_step == 0 and not (tmp_path / "dictionary").exists()


def test_resuming_from_the_data_module_does_not_warn_that_its_loader_is_not_resumable(
        llama_graph, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Lightning warns that a loader without ``state_dict`` makes a mid-epoch resume unreliable, and (on a machine
    with more cores than this one: patched) that it has few workers; the data module checkpoints its position and
    holds its batches in memory, so both warnings are hidden, during that fit only."""
    monkeypatch.setattr(data_connector, "suggested_max_num_workers", lambda devices: 8)
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "checkpoints", every_n_train_steps=3, save_top_k=-1)
    _trainer(tmp_path / "first", enable_checkpointing=True, callbacks=[checkpoint]).fit(
        DictionaryModule(llama_graph, _sae(), buffer_rows=32), datamodule=_chunks())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        before = list(warnings.filters)
        _trainer(tmp_path / "resumed").fit(DictionaryModule(llama_graph, _sae(), buffer_rows=32), datamodule=_chunks(),
                                           ckpt_path=tmp_path / "checkpoints" / "epoch=0-step=3.ckpt")
        after = list(warnings.filters)
    assert not [w for w in caught if "not resumable" in str(w.message) or "many workers" in str(w.message)]
    assert after == before
    with warnings.catch_warnings(record=True) as caught:  # a plain loader, not the data module: Lightning warns
        warnings.simplefilter("always")
        _trainer(tmp_path / "plain", max_steps=1).fit(DictionaryModule(llama_graph, _sae(), buffer_rows=32),
                                                      DataLoader(CHUNKS, batch_size=4))
    assert [w for w in caught if "many workers" in str(w.message)]
