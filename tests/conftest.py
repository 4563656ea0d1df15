"""Shared fixtures: tiny randomly initialised models (fast) and the embedded SmolLM2-135M (slow tests only)."""

from __future__ import annotations

import pytest
import torch
from torch import nn


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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``cuda`` are skipped on machines without a CUDA GPU (CI has none)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


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
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=100, max_position_embeddings=128)
    return LlamaForCausalLM(config).eval()


@pytest.fixture
def tiny_gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=100, n_positions=128,
                        bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config).eval()


@pytest.fixture
def token_ids() -> torch.Tensor:
    """Example input ids ``[batch 2, seq 7]``."""
    return torch.randint(0, 100, (2, 7), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="session")
def smollm2() -> tuple[nn.Module, object]:
    from gradpatch.models import load_embedded_model

    return load_embedded_model()
