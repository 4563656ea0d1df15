"""Dictionaries, attribution graphs and compiled patched graphs on each device (issues 47–49).

Each check is a function of the device. Tests taking the ``device`` fixture (conftest's ``DEVICES``) run on the CPU
in every run, CI included, and again on a CUDA GPU (that variant is marked ``cuda``): splicing with the error term,
dictionary training, evaluation and the attribution graph (on the CPU those two compare two CPU runs). The inductor
test of compiled graphs is marked ``cuda`` only (the reason is beside it) and is skipped without a CUDA GPU. Run
every GPU variant on a GPU machine with ``pytest -m cuda``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback, Trainer
from torch.utils.data import DataLoader

from gradpatch import AddPatch, PatchableGraph, ZeroPatch, testing
from gradpatch.circuits import ReplacementModel, attribute
from gradpatch.dictionaries import SkipTranscoder, SparseAutoencoder, evaluate_dictionary, splice
from recipes.dictionary import DictionaryModule

NODE = "model.layers_0.output"


def _llama() -> torch.nn.Module:
    return testing.tiny_llama(100, hidden=64, intermediate=128, init_std=0.02, max_position_embeddings=128,
                              pad_token_id=None, bos_token_id=1, eos_token_id=2).eval()


def _ids(device: str, rows: int = 2, seq: int = 8, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 100, (rows, seq), generator=torch.Generator().manual_seed(seed)).to(device)


def _sae(device: str) -> SparseAutoencoder:
    return SparseAutoencoder(64, 128, "topk", k=8, node=NODE, generator=torch.Generator().manual_seed(0)).to(device)


def check_splice_with_error_term_is_exact(device: str, dtype: torch.dtype) -> None:
    """A float32 SAE spliced with its error term into a model in ``dtype`` leaves the logits bit for bit; without it
    they move, and the latents are on the device."""
    model = _llama().to(device, dtype)
    ids = _ids(device)
    pg = PatchableGraph(model, ids, use_cache=False)
    with torch.no_grad():
        plain = pg(ids, use_cache=False).logits
        spliced = splice(pg, _sae(device), NODE)
        with pg.patch(spliced):
            kept = pg(ids, use_cache=False).logits
        with pg.patch(splice(pg, _sae(device), NODE, error_term=False)):
            dropped = pg(ids, use_cache=False).logits
    assert torch.equal(kept, plain)
    assert float((dropped - plain).abs().max()) > 0
    assert spliced.latents.device.type == torch.device(device).type and spliced.latents.shape == (2, 8, 128)


class _Devices(Callback):
    """The devices of the dictionary's encoder and of the frozen model at every training step."""

    def __init__(self) -> None:
        self.seen: set[tuple[str, str]] = set()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.seen.add((pl_module.dictionary.W_enc.device.type, next(pl_module.graph.parameters()).device.type))


def check_dictionary_training(device: str, root: Path) -> set[tuple[str, str]]:
    """Local training of a TopK SAE on the device lowers its FVU; returns the devices seen during the fit."""
    model = _llama().to(device)
    pg = PatchableGraph(model, _ids(device, rows=3, seq=6), use_cache=False)
    sae = _sae(device)
    module = DictionaryModule(pg, sae, buffer_rows=96, lr=1e-2, dead_after_tokens=64)
    fvus: list[float] = []
    original = module.loss_terms

    def recording(batch: torch.Tensor) -> dict[str, torch.Tensor]:
        terms = original(batch)
        fvus.append(float(terms["fvu"].detach()))
        return terms

    module.loss_terms = recording  # type: ignore[method-assign]
    devices = _Devices()
    accelerator = "gpu" if device == "cuda" else "cpu"
    Trainer(max_steps=42, accelerator=accelerator, devices=1, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(root),
            callbacks=[devices]).fit(module, DataLoader(_ids("cpu", rows=48, seq=8), batch_size=4))
    assert len(fvus) == 40 and sum(fvus[-3:]) / 3 < 0.8 * sum(fvus[:3]) / 3
    assert (root / "dictionary" / "dictionary.safetensors").exists()
    return devices.seen


def check_evaluation_matches_the_cpu(device: str) -> None:
    """``evaluate_dictionary`` on the device gives the CPU's numbers (relative 1e-4); with ``device="cpu"`` two
    independent CPU runs are compared."""
    batches = [_ids("cpu", seed=1), _ids("cpu", seed=2)]
    metrics = []
    for where in ("cpu", device):
        model = _llama().to(where)
        pg = PatchableGraph(model, batches[0].to(where), use_cache=False)
        result = evaluate_dictionary(pg, _sae(where), [b.to(where) for b in batches])
        metrics.append(result.to_dict())
    on_cpu, on_device = metrics
    for key, value in on_cpu.items():
        assert on_device[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key


def _replacement(device: str, prompt: torch.Tensor) -> ReplacementModel:
    model = _llama().to(device)
    pg = PatchableGraph(model, prompt.to(device), use_cache=False)
    generator = torch.Generator().manual_seed(0)
    transcoders = {}
    for layer in range(2):
        transcoder = SkipTranscoder(64, 64, activation="relu", input_node=f"model.layers_{layer}.mlp.x",
                                    output_node=f"model.layers_{layer}.mlp.output", generator=generator)
        with torch.no_grad():
            transcoder.W_skip.normal_(0, 0.05, generator=generator)
        transcoders[layer] = transcoder.to(device)
    return ReplacementModel(pg, transcoders, prompt.to(device))


def check_attribution_graph_matches_the_cpu(device: str) -> None:
    """The attribution graph built on the device has the CPU's feature nodes, and its edges within 1e-4 of the
    adjacency's scale. The random model's top logits are nearly tied (vocabulary 100), so rounding can reorder them:
    logit rows are compared for the tokens both graphs chose."""
    prompt = _ids("cpu", rows=1, seq=7, seed=3)
    on_cpu = attribute(_replacement("cpu", prompt), batch_size=32)
    on_device = attribute(_replacement(device, prompt), batch_size=32)
    assert torch.equal(on_device.active_features.cpu(), on_cpu.active_features)
    cpu_logits, device_logits = on_cpu.logit_tokens.tolist(), on_device.logit_tokens.cpu().tolist()
    sources = on_cpu.adjacency.shape[1] - len(cpu_logits)  # features, errors, tokens: the same on both sides
    rows = list(range(sources)) + [sources + cpu_logits.index(t) for t in device_logits if t in cpu_logits]
    device_rows = list(range(sources)) + [sources + i for i, t in enumerate(device_logits) if t in cpu_logits]
    assert len(rows) > sources
    expected = on_cpu.adjacency[rows][:, :sources]
    got = on_device.adjacency.cpu()[device_rows][:, :sources]
    assert float((got - expected).abs().max()) <= 1e-4 * float(expected.abs().max())


def check_compiled_graph_respects_patches(device: str, dtype: torch.dtype) -> None:
    """``pg.compile()`` with inductor on the device: none, Zero, Add, none again, Add again each within float noise of
    the eager graph, and each patch moves the logits by far more than that noise."""
    torch.compiler.reset()
    model = _llama().to(device, dtype)
    ids = _ids(device)
    eager = PatchableGraph(model, ids, use_cache=False)
    compiled = PatchableGraph(model, ids, use_cache=False)
    compiled.compile()
    node = "model.layers_0.mlp.down_proj.output"
    value = torch.randn(64, generator=torch.Generator().manual_seed(1)).to(device, dtype)
    sequence = [{}, {"model.layers_0.output": ZeroPatch()}, {node: AddPatch(value=value)}, {},
                {node: AddPatch(value=value)}]
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2  # logits of magnitude 0.7: a few bfloat16 ulps
    with torch.no_grad():
        plain = eager(ids, use_cache=False).logits.float()
        for patches in sequence:
            with compiled.patch(patches):
                got = compiled(ids, use_cache=False).logits.float()
            with eager.patch(patches):
                want = eager(ids, use_cache=False).logits.float()
            assert float((got - want).abs().max()) <= tolerance, list(patches.values())
            if patches:
                assert float((want - plain).abs().max()) > 10 * tolerance
    torch.compiler.reset()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_splice_with_error_term_is_exact(device: str, dtype: torch.dtype) -> None:
    check_splice_with_error_term_is_exact(device, dtype)


def test_dictionary_trains_on_the_device(device: str, tmp_path: Path) -> None:
    assert check_dictionary_training(device, tmp_path) == {(device, device)}


# On the CPU these two compare two independent CPU runs: a determinism check that runs the evaluation and the
# attribution graph (and the comparison itself) in CI; the comparison across devices is the cuda variant's.
def test_evaluation_on_the_device_matches_the_cpu(device: str) -> None:
    check_evaluation_matches_the_cpu(device)


def test_attribution_graph_on_the_device_matches_the_cpu(device: str) -> None:
    check_attribution_graph_matches_the_cpu(device)


# cuda only: its point is inductor's code for the GPU. On the CPU inductor compiles C++ for each patch set (38 s in
# float32, 56 s in bfloat16 on a 2-core machine), and the same patch sequence against the eager graph already runs on
# the CPU in test_compile.py's test_compiled_graph_follows_every_patch_set (a backend that skips inductor).
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_graph_respects_patches_on_the_gpu(dtype: torch.dtype) -> None:
    check_compiled_graph_respects_patches("cuda", dtype)
