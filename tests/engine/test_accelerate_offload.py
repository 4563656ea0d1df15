"""Models dispatched by accelerate with CPU and disk offload (weights on the meta device until the hooks load them)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer

from gradpatch import AddPatch, ExtractionOptions, PatchableGraph, ProbePatch, ZeroPatch
from recipes import DeltaModule, DeltaSpec, Objective, TargetSpec
from recipes.strategies import DeviceMapStrategy
from recipes.testing import save_tiny_backbone, tiny_backbone, tiny_tokenizer

DEVICE_MAP = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk",
              "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "disk"}


@pytest.fixture
def offloaded(tmp_path: Path) -> torch.nn.Module:
    """The tiny backbone saved, then loaded with layer 1 and the LM head offloaded to disk."""
    from transformers import AutoModelForCausalLM

    directory = save_tiny_backbone(tmp_path / "model")
    model = AutoModelForCausalLM.from_pretrained(directory, device_map=DEVICE_MAP,
                                                 offload_folder=tmp_path / "offload").eval()
    assert model.model.layers[1].mlp.down_proj.weight.is_meta and model.lm_head.weight.is_meta
    return model


@pytest.fixture
def tiny_llama() -> torch.nn.Module:
    """The same weights, all in memory."""
    return tiny_backbone()[0]


@pytest.fixture
def token_ids() -> torch.Tensor:
    return tiny_tokenizer()(["the city of Rome is", "the Eiffel Tower was in Paris"], padding=True,
                            return_tensors="pt").input_ids


def test_outputs_probes_patches_and_gradients(offloaded, tiny_llama, token_ids):
    pg = PatchableGraph(offloaded, token_ids, use_cache=False)
    expected = tiny_llama(token_ids, use_cache=False).logits
    torch.testing.assert_close(pg(token_ids, use_cache=False).logits, offloaded(token_ids, use_cache=False).logits)
    torch.testing.assert_close(pg(token_ids, use_cache=False).logits, expected)
    offloaded_weight = pg._graph_module.model.layers[1].mlp.down_proj.weight
    assert offloaded_weight.is_meta  # the graph keeps no copy of an offloaded weight between calls

    delta = torch.zeros(64, requires_grad=True)
    probe = ProbePatch()
    with pg.patch({"model.layers_1.mlp.down_proj.output": AddPatch(value=delta),
                   "model.layers_1.mlp.down_proj.weight": probe}):
        pg(token_ids, use_cache=False).logits.sum().backward()
    torch.testing.assert_close(probe.activation, tiny_llama.model.layers[1].mlp.down_proj.weight.detach())

    reference = PatchableGraph(tiny_llama, token_ids, use_cache=False)
    reference_delta = torch.zeros(64, requires_grad=True)
    with reference.patch({"model.layers_1.mlp.down_proj.output": AddPatch(value=reference_delta)}):
        reference(token_ids, use_cache=False).logits.sum().backward()
    torch.testing.assert_close(delta.grad, reference_delta.grad)

    with pg.patch({"lm_head.output": ZeroPatch()}):
        assert torch.count_nonzero(pg(token_ids, use_cache=False).logits) == 0
    assert pg._graph_module.lm_head.weight.is_meta


def test_opaque_wrappers_run_the_hooks_too(offloaded, tiny_llama, token_ids):
    pg = PatchableGraph(offloaded, ExtractionOptions(skip_compilation=True), token_ids, use_cache=False)
    torch.testing.assert_close(pg(token_ids, use_cache=False).logits, tiny_llama(token_ids, use_cache=False).logits)
    with pg.patch({"model.layers_1.mlp.down_proj.input": (probe := ProbePatch())}):
        pg(token_ids, use_cache=False)
    assert probe.activation.shape == (*token_ids.shape, 128)


def test_device_map_strategy_trains_a_delta_on_the_offloaded_model(offloaded):
    module = DeltaModule.from_model(offloaded, tiny_tokenizer(), deltas=[DeltaSpec("model.layers_1.output", "last")],
                                    objective=Objective(targets=[TargetSpec("the city of", "Rome")]), lr=0.1)
    trainer = Trainer(max_steps=3, accelerator="cpu", strategy=DeviceMapStrategy("cpu"), logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module)
    assert module.deltas[0].abs().sum() > 0
    assert offloaded.model.layers[1].mlp.down_proj.weight.is_meta
