"""Dictionaries that leave out the first positions of every sequence (``exclude_first_positions``, for attention
sinks): spliced only after them (also step by step in KV-cache generation), trained on their rows only, evaluated
on them only, and the setting saved with the dictionary."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer
from torch.utils.data import DataLoader

from gradpatch import ProbePatch, ZeroPatch, testing
from gradpatch.dictionaries import (DictionaryConfigError, SparseAutoencoder, evaluate_dictionary, load_dictionary,
                                    save_dictionary, splice, trained_positions)
from gradpatch.positions import Tokens
from recipes.dictionary import DictionaryModule, EndToEndDictionaryModule
from recipes.errors import RecipeConfigError

NODE = "model.layers_0.output"
IDS = testing.random_prompt_batch().clean  # [3, 6]


def _sae(first: int, node: str = NODE, seed: int = 0) -> SparseAutoencoder:
    return SparseAutoencoder(64, 128, "topk", k=4, node=node, exclude_first_positions=first,
                             generator=torch.Generator().manual_seed(seed))


def test_the_first_positions_keep_the_models_values(llama_graph) -> None:
    sae = _sae(2)
    assert trained_positions(sae) == Tokens(slice(2, None)) and trained_positions(_sae(0)) is None
    probe, spliced_probe = ProbePatch(), ProbePatch()
    s = splice(llama_graph, sae, error_term=False, slice=trained_positions(sae))
    with torch.no_grad():
        with llama_graph.patch({NODE: probe}):
            original = llama_graph(IDS).logits
        with llama_graph.patch(s), llama_graph.patch({NODE: spliced_probe}):  # after the splice
            logits = llama_graph(IDS).logits
    assert s.latents.shape == (3, 4, 128)
    assert torch.equal(logits[:, :2], original[:, :2])  # causal: the unspliced positions see no change
    assert not torch.allclose(logits[:, 2:], original[:, 2:], atol=1e-3)
    expected = torch.cat([probe.activation[:, :2], sae(probe.activation[:, 2:])], dim=1)
    torch.testing.assert_close(spliced_probe.activation, expected)


def test_generation_splices_every_new_token(llama_graph) -> None:
    sae = _sae(2)
    s = splice(llama_graph, sae, error_term=False, record=True, slice=trained_positions(sae))
    with llama_graph.patch(s):
        llama_graph.generate(IDS[:1], do_sample=False, pad_token_id=0, max_new_tokens=3)
    assert [tuple(z.shape) for z in s.patch.recorded] == [(1, 4, 128), (1, 1, 128), (1, 1, 128)]


def test_evaluation_scores_the_spliced_positions_only(llama_graph) -> None:
    sae = _sae(2)
    batches = [testing.random_prompt_batch(seed=seed).clean for seed in (1, 2)]  # [3, 6] each
    metrics = evaluate_dictionary(llama_graph, sae, batches)
    xs, losses = [], {"spliced": 0.0, "zero": 0.0}
    with torch.no_grad():
        for ids in batches:
            probe = ProbePatch()
            with llama_graph.patch({NODE: probe}):
                llama_graph(ids)
            xs.append(probe.activation[:, 2:].reshape(-1, 64))
            for name, patches in (("spliced", splice(llama_graph, sae, error_term=False, slice=Tokens(slice(2, None)))),
                                  ("zero", {NODE: ZeroPatch(slice=(slice(None), slice(2, None)))})):
                with llama_graph.patch(patches):
                    logits = llama_graph(ids).logits
                losses[name] += float(torch.nn.functional.cross_entropy(
                    logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(), reduction="sum"))
        x = torch.cat(xs)
        fvu = float((x - sae(x)).pow(2).sum() / (x - x.mean(0)).pow(2).sum())
    assert metrics.n_tokens == 2 * 3 * 4
    assert math.isclose(metrics.fvu, fvu, rel_tol=1e-5)
    assert math.isclose(metrics.ce_loss_spliced, losses["spliced"] / 30, rel_tol=1e-5)
    assert math.isclose(metrics.ce_loss_zero_ablation, losses["zero"] / 30, rel_tol=1e-5)
    short = evaluate_dictionary(llama_graph, sae, [IDS[:, :2]] + batches)  # a batch with nothing to splice
    assert short.n_tokens == metrics.n_tokens and math.isclose(short.fvu, metrics.fvu, rel_tol=1e-9)


def _steps(module: DictionaryModule, root: Path, steps: int) -> None:
    trainer = Trainer(max_steps=steps, accelerator="cpu", logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(root))
    chunks = torch.randint(3, 100, (16, 8), generator=torch.Generator().manual_seed(0))
    trainer.fit(module, DataLoader(chunks, batch_size=4))


def test_local_training_reads_the_rows_after_the_excluded_positions(llama_graph, tmp_path: Path) -> None:
    module = DictionaryModule(llama_graph, _sae(3), buffer_rows=20, lr=1e-2)
    pushed: list[torch.Tensor] = []
    push = module.buffer.push
    module.buffer.push = lambda rows: (pushed.append(rows), push(rows))[-1]  # type: ignore[method-assign]
    _steps(module, tmp_path, steps=2)
    chunks = torch.randint(3, 100, (16, 8), generator=torch.Generator().manual_seed(0))
    probe = ProbePatch()
    with torch.no_grad(), llama_graph.patch({NODE: probe}):
        llama_graph(chunks[:4])
    assert [tuple(rows.shape) for rows in pushed] == [(20, 64), (20, 64)]  # 4 sequences × (8 − 3) positions
    torch.testing.assert_close(pushed[0], probe.activation[:, 3:].reshape(-1, 64))


def test_end_to_end_training_splices_after_the_excluded_positions(llama_graph, tmp_path: Path) -> None:
    sae = _sae(2, node="model.layers_1.output")
    module = EndToEndDictionaryModule(llama_graph, sae, lr=1e-2)
    terms = module.loss_terms(IDS)
    terms["loss"].backward()
    assert sae.W_enc.grad is not None and float(sae.W_enc.grad.abs().sum()) > 0
    assert math.isfinite(float(terms["fvu"])) and float(terms["l0"]) == 4.0
    _steps(module, tmp_path, steps=2)
    assert load_dictionary(tmp_path / "dictionary").config.exclude_first_positions == 2


def test_the_setting_is_saved_checked_and_shared(llama_graph, tmp_path: Path) -> None:
    save_dictionary(_sae(2), tmp_path / "d")
    assert load_dictionary(tmp_path / "d").config.exclude_first_positions == 2
    with pytest.raises(DictionaryConfigError, match="exclude_first_positions"):
        _sae(-1)
    with pytest.raises(RecipeConfigError, match="same first positions"):
        DictionaryModule(llama_graph, [_sae(1), _sae(2, node="model.layers_1.output")])


@pytest.mark.parametrize("end_to_end", [False, True])
def test_the_first_step_sets_b_dec_to_the_mean_of_its_targets(llama_graph, tmp_path: Path, end_to_end: bool) -> None:
    sae = _sae(2, node="model.layers_1.output")
    kind = EndToEndDictionaryModule if end_to_end else DictionaryModule
    module = kind(llama_graph, sae, lr=1e-2, **({} if end_to_end else {"buffer_rows": 24}))
    seen: list[torch.Tensor] = []
    original = module.loss_terms
    module.loss_terms = lambda batch: (seen.append(sae.b_dec.detach().clone()), original(batch))[-1]  # type: ignore
    _steps(module, tmp_path, steps=2)
    chunks = torch.randint(3, 100, (16, 8), generator=torch.Generator().manual_seed(0))
    probe = ProbePatch()
    with torch.no_grad(), llama_graph.patch({"model.layers_1.output": probe}):
        llama_graph(chunks[:4])
    torch.testing.assert_close(seen[0], probe.activation[:, 2:].reshape(-1, 64).mean(0))  # before the first update
    assert not bool(module.b_dec_pending) and not torch.equal(seen[1], seen[0])  # set once, then trained
    kept = kind(llama_graph, _sae(2, node="model.layers_1.output"), b_dec_init="keep")
    assert not bool(kept.b_dec_pending)
    with pytest.raises(RecipeConfigError, match="b_dec_init"):
        kind(llama_graph, _sae(2), b_dec_init="median")  # type: ignore[arg-type]
