"""Fixtures of the engine's tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture
def fresh_dynamo() -> Iterator[None]:
    """dynamo's caches emptied before and after the test, so compiled graphs and their counts are the test's own."""
    torch.compiler.reset()
    yield
    torch.compiler.reset()
