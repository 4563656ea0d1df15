"""Shared fixtures: tiny randomly initialised models (fast) and the embedded SmolLM2-135M (slow tests only)."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from gradpatch import PatchableGraph, testing


class TupleOutputModule(nn.Module):
    """One Linear called twice, returning a tuple (graphpatch's standard multiply-invoked example)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.linear(x), self.linear(x * 2)


class MLP(nn.Module):
    """Two layers with a dropout between them, returning a dict."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(4, 8)
        self.dropout = nn.Dropout(0.5)
        self.down = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> dict[str, torch.Tensor]:
        hidden = torch.relu(self.up(x))
        return {"out": self.down(self.dropout(hidden)) * scale, "hidden": hidden}


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist (``make test`` runs ``-n auto``), each worker's torch gets its share of the cores, so that
    the workers do not oversubscribe them (``PYTEST_XDIST_WORKER_COUNT`` is set in the workers only)."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(workers)))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``cuda`` are skipped on machines without a CUDA GPU (CI has none)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
"""The devices a device-generic check runs on: the CPU (every run, CI included) and a CUDA GPU (marked ``cuda``,
so skipped without one)."""


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> str:
    """Each of :data:`DEVICES` in turn; a test taking ``device`` runs once per device."""
    return request.param


@pytest.fixture
def tuple_module() -> TupleOutputModule:
    torch.manual_seed(0)
    return TupleOutputModule()


@pytest.fixture
def mlp() -> MLP:
    torch.manual_seed(0)
    return MLP().eval()


@pytest.fixture
def tiny_llama() -> nn.Module:
    """A 2-layer Llama (d_model 64, vocabulary 100, transformers' 0.02 initialisation, seed 0)."""
    return testing.tiny_llama(100, hidden=64, intermediate=128, init_std=0.02, max_position_embeddings=128,
                              pad_token_id=None, bos_token_id=1, eos_token_id=2)


@pytest.fixture
def tiny_gpt2() -> nn.Module:
    """A 2-layer GPT-2 (d_model 64, vocabulary 100, transformers' 0.02 initialisation, seed 0)."""
    return testing.tiny_gpt2(100, hidden=64, init_std=0.02, n_positions=128)


@pytest.fixture
def llama_graph(tiny_llama) -> PatchableGraph:
    """The tiny Llama's graph, built on :func:`gradpatch.testing.random_prompt_batch`'s clean prompts ``[3, 6]``."""
    return PatchableGraph(tiny_llama, testing.random_prompt_batch().clean, use_cache=False)


@pytest.fixture
def gpt2_graph(tiny_gpt2) -> PatchableGraph:
    """The tiny GPT-2's graph, likewise."""
    return PatchableGraph(tiny_gpt2, testing.random_prompt_batch().clean, use_cache=False)


@pytest.fixture
def token_ids() -> torch.Tensor:
    """Example input ids ``[batch 2, seq 7]``."""
    return torch.randint(0, 100, (2, 7), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="session")
def smollm2() -> tuple[nn.Module, object]:
    from gradpatch.files.loaders import load_embedded_model

    return load_embedded_model()
