"""End-to-end and multi-node dictionary training on the tiny Llama (recipes.dictionary): the CE loss increase logged
during training, Braun et al.'s e2e+ds loss and its gradient against the formula written out, several dictionaries
in one run (local: the same weights as one run per dictionary; end to end: spliced together), and resuming from a
Lightning checkpoint (the same weights as the uninterrupted run)."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader

from gradpatch import CustomPatch, PatchableGraph, ProbePatch, testing
from gradpatch.dictionaries import SparseAutoencoder, Transcoder, load_dictionary
from recipes.dictionary import (DictionaryModule, EndToEndDictionaryModule, downstream_residual_nodes,
                                spliced_ce_increase)
from recipes.errors import RecipeConfigError

CHUNKS = torch.randint(3, 100, (48, 8), generator=torch.Generator().manual_seed(0))  # 48 sequences of 8 tokens


def _sae(node: str, seed: int = 0, activation: str = "topk") -> SparseAutoencoder:
    return SparseAutoencoder(64, 128, activation, k=8 if activation == "topk" else None, node=node,
                             generator=torch.Generator().manual_seed(seed))


def _trainer(root: Path, logger: object = False, **options: object) -> Trainer:
    return Trainer(accelerator="cpu", logger=logger, enable_checkpointing=False, enable_progress_bar=False,
                   enable_model_summary=False, default_root_dir=str(root), **options)


def _logged(root: Path, name: str) -> dict[int, float]:
    """``name``'s values by step in the CSVLogger's metrics.csv under ``root``."""
    (path,) = root.glob("**/metrics.csv")
    with path.open() as handle:
        return {int(row["step"]): float(row[name]) for row in csv.DictReader(handle) if row.get(name)}


def _ce(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


def test_ce_increase_is_the_spliced_models_cross_entropy_minus_the_models(llama_graph) -> None:
    sae, ids = _sae("model.layers_0.output"), CHUNKS[:4]
    with torch.no_grad():
        original = _ce(llama_graph(ids, use_cache=False).logits, ids)
        with llama_graph.patch({"model.layers_0.output": CustomPatch(custom_op=sae)}):  # x -> x̂, no error term
            spliced = _ce(llama_graph(ids, use_cache=False).logits, ids)
    assert spliced > original + 0.01
    assert spliced_ce_increase(llama_graph, [sae], ids) == pytest.approx(float(spliced - original), rel=1e-5)
    # a pass per chunk of rows (bounded logits memory), an uneven last chunk included: the same batch mean, to float32
    # rounding of the two CEs (~4.6 each; their difference ~0.01)
    for rows_per_pass in (1, 3, 4):
        assert spliced_ce_increase(llama_graph, [sae], ids, rows_per_pass=rows_per_pass) == pytest.approx(
            float(spliced - original), abs=2e-6)


def test_local_training_logs_the_ce_increase_every_n_steps(llama_graph, tmp_path: Path) -> None:
    sae = _sae("model.layers_0.output")
    module = DictionaryModule(llama_graph, sae, buffer_rows=32, lr=1e-2, ce_every_n_steps=3)  # a step per batch
    _trainer(tmp_path, CSVLogger(tmp_path), max_steps=6, log_every_n_steps=1).fit(
        module, DataLoader(CHUNKS[:24], batch_size=4))
    logged = _logged(tmp_path, "ce_increase")
    assert sorted(logged) == [3, 6]  # after the optimizer steps 3 and 6
    assert logged[6] == pytest.approx(float(spliced_ce_increase(llama_graph, [sae], CHUNKS[20:24])), rel=1e-5)


def test_downstream_residual_nodes_are_the_later_layers_but_the_last() -> None:
    pg = PatchableGraph(testing.tiny_llama(100, layers=4), testing.random_prompt_batch().clean, use_cache=False)
    assert downstream_residual_nodes(pg, "model.layers_0.output") == ["model.layers_1.output", "model.layers_2.output"]
    assert downstream_residual_nodes(pg, "model.layers_2.output") == []
    with pytest.raises(RecipeConfigError, match="downstream_nodes explicitly"):
        downstream_residual_nodes(pg, "model.layers_0.mlp.x")


def test_e2e_ds_loss_and_gradient_follow_braun_et_al(llama_graph) -> None:
    """loss = KL(p ‖ p̂) + β_ds · mean_k MSE(â_k, a_k), against the quantities computed with plain patches."""
    node, downstream, beta = "model.layers_0.output", ["model.layers_1.output", "model.norm.output"], 3.0
    sae, ids = _sae(node), CHUNKS[:4]
    module = EndToEndDictionaryModule(llama_graph, sae, downstream_nodes=downstream, downstream_coefficient=beta)
    terms = module.loss_terms(ids)
    (grad,) = torch.autograd.grad(terms["loss"], [sae.W_dec])

    probes = {name: ProbePatch() for name in downstream}
    with torch.no_grad(), llama_graph.patch(probes):
        reference = llama_graph(ids, use_cache=False).logits
    kept: dict[str, torch.Tensor] = {}
    keep = {name: CustomPatch(custom_op=lambda value, name=name: kept.setdefault(name, value)) for name in downstream}
    with llama_graph.patch({node: CustomPatch(custom_op=sae), **keep}):
        logits = llama_graph(ids, use_cache=False).logits
    p, log_p, log_q = reference.softmax(-1), reference.log_softmax(-1), logits.log_softmax(-1)
    kl = (p * (log_p - log_q)).sum(-1).mean()
    mse = sum(((kept[name] - probes[name].activation) ** 2).mean() for name in downstream) / len(downstream)
    (expected,) = torch.autograd.grad(kl + beta * mse, [sae.W_dec])
    assert float(terms["kl"]) == pytest.approx(float(kl), rel=1e-5)
    assert float(terms["downstream_mse"]) == pytest.approx(float(mse), rel=1e-5) and float(mse) > 0
    assert float(terms["loss"]) == pytest.approx(float(kl + beta * mse), rel=1e-5)
    assert float(terms["ce_increase"]) == pytest.approx(float(_ce(logits, ids) - _ce(reference, ids)), rel=1e-4)
    torch.testing.assert_close(grad, expected, rtol=1e-4, atol=1e-7)


def test_e2e_ds_settings_are_checked(llama_graph) -> None:
    with pytest.raises(RecipeConfigError, match="downstream_nodes"):
        EndToEndDictionaryModule(llama_graph, _sae("model.layers_0.output"), downstream_coefficient=1.0)
    with pytest.raises(KeyError, match="model.layers_9.output"):
        EndToEndDictionaryModule(llama_graph, _sae("model.layers_0.output"), downstream_nodes=["model.layers_9.output"],
                                 downstream_coefficient=1.0)
    with pytest.raises(RecipeConfigError, match="writing different nodes"):
        DictionaryModule(llama_graph, [_sae("model.layers_0.output"), _sae("model.layers_0.output", seed=1)])


def _transcoder(seed: int = 2) -> Transcoder:
    return Transcoder(64, 96, activation="topk", k=4, input_node="model.layers_0.mlp.x",
                      output_node="model.layers_0.mlp.output", generator=torch.Generator().manual_seed(seed))


def test_several_dictionaries_in_one_local_run_train_as_they_would_alone(llama_graph, tmp_path: Path) -> None:
    """The losses are independent, Adam is per tensor and the buffer draws the same rows for every node: one run of
    three dictionaries gives each the weights of its own run."""
    def fit(dictionaries: list, root: Path) -> DictionaryModule:
        module = DictionaryModule(llama_graph, dictionaries, buffer_rows=64, lr=1e-2, dead_after_tokens=64)
        _trainer(root, max_steps=8).fit(module, DataLoader(CHUNKS[:40], batch_size=4))
        return module

    together = [_sae("model.layers_0.output"), _sae("model.layers_1.output", seed=1), _transcoder()]
    module = fit(together, tmp_path / "together")
    alone = [_sae("model.layers_0.output"), _sae("model.layers_1.output", seed=1), _transcoder()]
    for i, dictionary in enumerate(alone):
        fit([dictionary], tmp_path / f"alone{i}")
    for joint, single in zip(together, alone):
        for name, tensor in joint.state_dict().items():
            torch.testing.assert_close(tensor, single.state_dict()[name], rtol=1e-5, atol=1e-6)
    assert module.nodes == ["model.layers_0.output", "model.layers_1.output", "model.layers_0.mlp.x",
                            "model.layers_0.mlp.output"]
    saved = load_dictionary(tmp_path / "together" / "dictionary" / "model.layers_0.mlp.output",
                            model=llama_graph.wrapped_model)
    assert torch.equal(saved.W_dec, together[2].W_dec.detach())
    assert (tmp_path / "together" / "dictionary" / "model.layers_1.output" / "dictionary.json").is_file()


def test_several_dictionaries_train_end_to_end_spliced_together(llama_graph, tmp_path: Path) -> None:
    saes = [_sae("model.layers_0.output"), _sae("model.layers_1.output", seed=1)]
    module = EndToEndDictionaryModule(llama_graph, saes, lr=1e-2, b_dec_init="keep")  # from b_dec = 0: a larger KL
    _trainer(tmp_path, CSVLogger(tmp_path), max_steps=30, log_every_n_steps=1).fit(
        module, DataLoader(CHUNKS[:40].repeat(3, 1), batch_size=4))
    kl = list(_logged(tmp_path, "kl").values())
    assert len(kl) == 30 and sum(kl[-3:]) < 0.6 * sum(kl[:3])
    assert set(_logged(tmp_path, "fvu/model.layers_1.output")) == set(_logged(tmp_path, "l0/model.layers_0.output"))


@pytest.mark.parametrize("end_to_end", [False, True])
def test_resuming_from_a_checkpoint_continues_the_run(llama_graph, tmp_path: Path, end_to_end: bool) -> None:
    """A two-epoch run checkpointed after its first epoch, resumed from there: the weights, Adam's moments and the
    firing counters of the uninterrupted run (a local buffer of 3 batches: its rows and generator travel in the
    checkpoint, and it is drained in the run's last batches, not the first epoch's)."""
    def module() -> DictionaryModule:
        sae = _sae("model.layers_0.output")
        if end_to_end:
            return EndToEndDictionaryModule(llama_graph, sae, lr=1e-2)
        return DictionaryModule(llama_graph, sae, buffer_rows=96, lr=1e-2, dead_after_tokens=48)

    class FirstEpoch(Callback):
        def on_train_epoch_end(self, trainer: Trainer, pl_module: DictionaryModule) -> None:
            if trainer.current_epoch == 0:
                trainer.save_checkpoint(tmp_path / "epoch1.ckpt")
                self.W_enc = pl_module.dictionary.W_enc.detach().clone()

    data = DataLoader(CHUNKS[:24], batch_size=4)  # 6 batches an epoch
    straight, first = module(), FirstEpoch()
    _trainer(tmp_path / "straight", max_epochs=2, callbacks=[first]).fit(straight, data)
    resumed = module()
    _trainer(tmp_path / "resumed", max_epochs=2).fit(resumed, data, ckpt_path=tmp_path / "epoch1.ckpt")
    assert resumed.global_step == straight.global_step == 12
    expected = straight.trainable_state_dict()
    for name, tensor in resumed.trainable_state_dict().items():
        torch.testing.assert_close(tensor, expected[name], rtol=1e-5, atol=1e-6)
    assert not torch.equal(first.W_enc, straight.dictionary.W_enc)
