"""The cache folders: an environment variable overrides ``~/.cache/gradpatch/<name>`` for statistics and models."""

from __future__ import annotations

from pathlib import Path

import pytest

from editors.statistics.second_moment import default_cache_dir
from gradpatch.files.cache import cache_folder
from gradpatch.files.gguf_cache import default_model_cache_dir


def test_the_variable_wins_and_its_tilde_is_expanded(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("GRADPATCH_STATS_DIR", "~/stats_here")
    monkeypatch.setenv("GRADPATCH_MODEL_CACHE", str(tmp_path / "models_here"))
    assert default_cache_dir() == tmp_path / "stats_here"
    assert default_model_cache_dir() == tmp_path / "models_here"


@pytest.mark.parametrize("value", [None, ""])
def test_unset_or_empty_falls_back_to_the_home_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                     value: str | None) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    for var in ("GRADPATCH_STATS_DIR", "GRADPATCH_MODEL_CACHE", "GRADPATCH_TEST_CACHE"):
        if value is None:
            monkeypatch.delenv(var, raising=False)
        else:
            monkeypatch.setenv(var, value)
    assert default_cache_dir() == tmp_path / ".cache" / "gradpatch" / "stats"
    assert default_model_cache_dir() == tmp_path / ".cache" / "gradpatch" / "models"
    assert cache_folder("GRADPATCH_TEST_CACHE", "other") == tmp_path / ".cache" / "gradpatch" / "other"
    assert not (tmp_path / ".cache").exists()  # named, not created
