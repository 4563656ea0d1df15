"""bitsandbytes 8-bit (Linear8bitLt) and 4-bit (Linear4bit, nf4 and fp4) models, on bitsandbytes' CPU backend.

Skipped when bitsandbytes is not installed (``pip install -e ".[bnb]"``).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from gradpatch import AddPatch, NodePathError, PatchableGraph, ProbePatch, ZeroPatch
from recipes.testing import save_tiny_backbone, tiny_tokenizer

bitsandbytes = pytest.importorskip("bitsandbytes")

CONFIGS = {
    "int8": {"load_in_8bit": True},
    "nf4": {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_compute_dtype": torch.float32},
    "fp4": {"load_in_4bit": True, "bnb_4bit_quant_type": "fp4", "bnb_4bit_compute_dtype": torch.float32},
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_backbone(tmp_path_factory.mktemp("model"))


def quantized(saved: Path, kind: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoModelForCausalLM.from_pretrained(saved, quantization_config=BitsAndBytesConfig(**CONFIGS[kind]),
                                                    device_map="cpu").eval()


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_quantized_layers_are_patchable_leaves(saved, kind):
    model = quantized(saved, kind)
    layer_class = bitsandbytes.nn.Linear8bitLt if kind == "int8" else bitsandbytes.nn.Linear4bit
    assert isinstance(model.model.layers[0].mlp.down_proj, layer_class)
    ids = tiny_tokenizer()(["the city of Rome is", "I feel happy today"], padding=True, return_tensors="pt").input_ids
    pg = PatchableGraph(model, ids, use_cache=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = model(ids, use_cache=False).logits
        assert torch.equal(pg(ids, use_cache=False).logits, expected)

        delta = torch.zeros(64, requires_grad=True)
        with pg.patch({"model.layers_0.mlp.down_proj.input": (inputs := ProbePatch()),
                       "model.layers_0.mlp.down_proj.output": [(outputs := ProbePatch()), AddPatch(value=delta)],
                       "model.layers_0.mlp.act_fn.output": (activations := ProbePatch()),
                       "model.layers_0.mlp.down_proj.weight": (weight := ProbePatch())}):
            pg(ids, use_cache=False).logits.sum().backward()
        assert inputs.activation.shape == (*ids.shape, 128) and outputs.activation.shape == (*ids.shape, 64)
        assert activations.activation.shape == (*ids.shape, 128)
        assert weight.activation.dtype in (torch.int8, torch.uint8)  # the quantized storage, read only
        assert delta.grad is not None and delta.grad.abs().sum() > 0

        with pg.patch({"model.layers_0.mlp.down_proj.output": ZeroPatch()}):
            assert not torch.equal(pg(ids, use_cache=False).logits, expected)
    with pytest.raises(NodePathError, match="quantized storage.*input or output"):
        with pg.patch({"model.layers_0.mlp.down_proj.weight": ZeroPatch()}):
            pass
