"""Device behaviour: fp32/bf16/fp16 equality with eager, gradients, accelerate CPU offload onto a GPU, 8-bit layers,
memory, intervention training on the model's device.

Tests taking the ``device`` fixture (conftest's ``DEVICES``) run on the CPU in every run, CI included, and again on a
CUDA GPU (that variant is marked ``cuda``): ``test_outputs_equal_eager_and_gradients_flow`` and
``test_intervention_training_on_the_models_device``. The others are marked ``cuda`` only, each with the reason (they
test the GPU itself: offload onto it, its int8 kernels, its memory) and are skipped without a CUDA GPU. Run every
GPU variant on a GPU machine with ``pytest -m cuda``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gradpatch import AddPatch, PatchableGraph, ProbePatch
from recipes.testing import save_tiny_backbone, tiny_backbone, tiny_tokenizer


def token_ids(device: str) -> torch.Tensor:
    return tiny_tokenizer()(["the city of Rome is", "I feel happy today"], padding=True,
                            return_tensors="pt").input_ids.to(device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_outputs_equal_eager_and_gradients_flow(device: str, dtype: torch.dtype):
    model = tiny_backbone()[0].to(device, dtype)
    ids = token_ids(device)
    pg = PatchableGraph(model, ids, use_cache=False)
    with torch.no_grad():
        assert torch.equal(pg(ids, use_cache=False).logits, model(ids, use_cache=False).logits)
    delta = torch.zeros(64, device=device, dtype=dtype, requires_grad=True)
    with pg.patch({"model.layers_1.mlp.down_proj.output": AddPatch(value=delta)}):
        pg(ids, use_cache=False).logits.float().sum().backward()
    assert delta.grad is not None and torch.isfinite(delta.grad).all() and delta.grad.abs().sum() > 0


@pytest.mark.cuda  # accelerate's offload hooks moving CPU-held weights onto a GPU: needs the GPU itself
def test_cpu_offload_onto_the_gpu(tmp_path: Path):
    from transformers import AutoModelForCausalLM

    directory = save_tiny_backbone(tmp_path / "model")
    device_map = {"model.embed_tokens": 0, "model.layers.0": 0, "model.layers.1": "cpu", "model.norm": 0,
                  "model.rotary_emb": 0, "lm_head": 0}
    model = AutoModelForCausalLM.from_pretrained(directory, device_map=device_map).eval()
    ids = token_ids("cuda")
    pg = PatchableGraph(model, ids, use_cache=False)
    expected = tiny_backbone()[0].to("cuda")(ids, use_cache=False).logits
    torch.testing.assert_close(pg(ids, use_cache=False).logits, expected)
    with pg.patch({"model.layers_1.mlp.down_proj.input": (probe := ProbePatch())}):
        pg(ids, use_cache=False)
    assert probe.activation.shape == (*ids.shape, 128)


@pytest.mark.cuda  # bitsandbytes' LLM.int8 layers run their int8 kernels on a CUDA GPU only
def test_int8_layers_on_the_gpu(tmp_path: Path):
    pytest.importorskip("bitsandbytes")
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    directory = save_tiny_backbone(tmp_path / "model")
    model = AutoModelForCausalLM.from_pretrained(directory, device_map={"": 0}, dtype=torch.float16,
                                                 quantization_config=BitsAndBytesConfig(load_in_8bit=True)).eval()
    ids = token_ids("cuda")
    pg = PatchableGraph(model, ids, use_cache=False)
    with torch.no_grad():
        assert torch.equal(pg(ids, use_cache=False).logits, model(ids, use_cache=False).logits)
    delta = torch.zeros(64, device="cuda", dtype=torch.float16, requires_grad=True)
    with pg.patch({"model.layers_0.mlp.down_proj.output": AddPatch(value=delta)}):
        pg(ids, use_cache=False).logits.float().sum().backward()
    assert delta.grad is not None and delta.grad.abs().sum() > 0


@pytest.mark.cuda  # measured with torch.cuda.memory_allocated: the CPU has no allocator statistics to compare
def test_no_second_copy_of_the_weights():
    from gradpatch.files.loaders import random_embedded_model

    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    model = random_embedded_model(torch.bfloat16, "cuda")
    weights = torch.cuda.memory_allocated() - before
    pg = PatchableGraph(model, torch.randint(0, 1000, (1, 10), device="cuda"), use_cache=False)
    assert torch.cuda.memory_allocated() - before <= 1.05 * weights
    del pg


def test_intervention_training_on_the_models_device(device: str, tmp_path: Path):
    """The left-padded example batch that extracts the graph follows the model onto its device (it was built on the
    CPU, and extraction failed on a CUDA model); Lightning then trains the DAS patch on that device. Where the
    training ran is recorded during the fit: after ``Trainer.fit`` Lightning moves the module back to the CPU. The
    device bug shows only on the GPU; the CPU variant checks the same training end to end."""
    import json

    from lightning.pytorch import Callback, Trainer

    class Devices(Callback):
        """The devices of the patch's R and of the frozen model at every training step."""

        def __init__(self) -> None:
            self.seen: set[tuple[str, str]] = set()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self.seen.add((pl_module.patches[0].R.device.type, next(pl_module.graph.parameters()).device.type))

    from recipes import CounterfactualDataModule, InterventionModule

    cities = {"Paris": "France", "Rome": "Italy", "Berlin": "Germany", "Madrid": "Spain"}
    records = [{"base": f"the city {a} is in the country", "source": f"a big city {b} is in", "label": cities[b],
                "base_subject": a, "source_subject": b} for a in cities for b in cities if a != b]
    (tmp_path / "train.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    model, tokenizer = tiny_backbone()
    module = InterventionModule.from_model(model.to(device), tokenizer, lr=0.05, interventions=[
        {"node": "model.layers_0.output", "kind": "rotated", "dim": 4}])
    before = module.patches[0].R.detach().cpu().clone()
    devices = Devices()
    accelerator = "gpu" if device == "cuda" else "cpu"
    Trainer(accelerator=accelerator, devices=1, max_steps=2, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, callbacks=[devices]).fit(
        module, datamodule=CounterfactualDataModule(str(tmp_path / "train.jsonl"), batch_size=6))
    after = module.patches[0].R.detach().cpu()
    assert devices.seen == {(device, device)} and float((after - before).abs().max()) > 0
    assert 0.0 <= float(module.iia(module.trainer.datamodule.train_records)) <= 1.0
