"""ROME edits applied as patches on the layer output: equal to the weight write, and the way to edit weights
that cannot be written (bitsandbytes 8-bit/4-bit, accelerate offload)."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from editors import ROME, Corpus, Edit, EditRequest, ROMEConfig, resolve_layer
from editors.errors import EditError
from gradpatch import PatchableGraph
from gradpatch.testing import tiny_gpt2, tiny_llama
from recipes.testing import WORDS, save_tiny_backbone, tiny_backbone, tiny_tokenizer

NODES = {"llama": "model.layers_0.mlp.down_proj", "gpt2": "transformer.h_0.mlp.c_proj"}


def _random_edit(pg: PatchableGraph, node: str, scale: float = 0.3) -> Edit:
    layer = resolve_layer(pg, node)
    generator = torch.Generator().manual_seed(0)
    return Edit(node=node, u=torch.randn(layer.d_in, generator=generator, dtype=torch.float64) * scale,
                v=torch.randn(layer.d_out, generator=generator, dtype=torch.float64) * scale)


@pytest.mark.parametrize("kind", sorted(NODES))
def test_patch_mode_equals_the_weight_write(kind):
    model = (tiny_llama if kind == "llama" else tiny_gpt2)(100)
    ids = torch.randint(0, 100, (2, 9), generator=torch.Generator().manual_seed(1))
    pg = PatchableGraph(model, ids, use_cache=False)
    clean = pg(ids, use_cache=False).logits
    edit = _random_edit(pg, NODES[kind])
    edit.apply(pg)
    weighted = pg(ids, use_cache=False).logits
    edit.restore(pg)
    edit.apply(pg, mode="patch")
    patched = pg(ids, use_cache=False).logits
    assert (weighted - clean).abs().max() > 1e-2  # the edit changes the output...
    assert (patched - weighted).abs().max() <= 1e-5  # ...and both modes change it alike
    with pytest.raises(EditError, match="already applied"):
        edit.apply(pg, mode="patch")
    edit.restore(pg)
    assert torch.equal(pg(ids, use_cache=False).logits, clean)
    with pg.patch(edit.as_patches(pg)):
        torch.testing.assert_close(pg(ids, use_cache=False).logits, patched, rtol=0, atol=0)


def _load(directory: Path, **kwargs) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoModelForCausalLM.from_pretrained(directory, **kwargs).eval()


@pytest.mark.parametrize("kind", ["int8", "offload"])
def test_rome_on_weights_that_cannot_be_written(kind, tmp_path):
    if kind == "int8":
        pytest.importorskip("bitsandbytes")
        from transformers import BitsAndBytesConfig

        options = {"quantization_config": BitsAndBytesConfig(load_in_8bit=True), "device_map": "cpu"}
    else:
        options = {"device_map": {"model.embed_tokens": "cpu", "model.layers.0": "disk", "model.layers.1": "cpu",
                                  "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"},
                   "offload_folder": tmp_path / "offload"}
    model = _load(save_tiny_backbone(tmp_path / "model"), **options)
    tokenizer = tiny_tokenizer()
    node = "model.layers_0.mlp.down_proj"
    pg = PatchableGraph(model, tokenizer(["the city of Rome"], return_tensors="pt").input_ids, use_cache=False)
    config = ROMEConfig(n_samples=16, max_length=32, cache_dir=str(tmp_path), progress=False, steps=25,
                        clamp_factor=500.0, context_length_params=((3, 2),), allow_unconverged=True)
    generator = torch.Generator().manual_seed(0)  # varied contexts: keys that span the layer's input space
    texts = [" ".join(WORDS[int(i)] for i in torch.randint(0, len(WORDS), (24,), generator=generator))
             for _ in range(16)]
    rome = ROME(pg, tokenizer, node, config, corpus=Corpus(name="toy", texts=texts))
    # Tiny random models barely move information between positions: the fact ends with its subject.
    request = EditRequest(prompt="I feel happy in {}", subject="the Eiffel Tower", target_new="Rome",
                          target_true="Paris")
    prompt = tokenizer([request.text], return_tensors="pt").input_ids
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        edit = rome.compute(request)
        before = pg(prompt, use_cache=False).logits[0, -1].log_softmax(-1)
        with pytest.raises(EditError, match="apply it as a patch"):
            edit.apply(pg)
        edit.apply(pg, mode="patch", allow_unconverged=True)  # a tiny random model need not converge
        after = pg(prompt, use_cache=False).logits[0, -1].log_softmax(-1)
        edit.restore(pg)
        restored = pg(prompt, use_cache=False).logits[0, -1].log_softmax(-1)
    rome_id = tokenizer.convert_tokens_to_ids("Rome")
    assert after[rome_id] > before[rome_id] + 0.5  # the edit moves the prediction towards " Rome"
    assert torch.equal(restored, before)
    if kind == "offload":  # the same weights in memory, edited in place, predict alike
        in_memory = tiny_backbone()[0]
        edit.apply(in_memory, check_fingerprint=False, allow_unconverged=True)
        torch.testing.assert_close(in_memory(prompt, use_cache=False).logits[0, -1].log_softmax(-1), after,
                                   rtol=0, atol=1e-5)
