"""Where gradpatch keeps what it computes once and reads again (statistics, converted models)."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["cache_folder"]


def cache_folder(env_var: str, name: str) -> Path:
    """``$env_var`` (``~`` expanded) if it is set and not empty, else ``~/.cache/gradpatch/<name>``.

    Args:
        env_var: the environment variable that overrides the folder, e.g. ``"GRADPATCH_STATS_DIR"``.
        name: the folder's name under ``~/.cache/gradpatch``, e.g. ``"stats"``.

    Returns:
        The folder's path; it is not created here (its writer creates it and names ``env_var`` when it cannot).
    """
    value = os.environ.get(env_var)
    return Path(value).expanduser() if value else Path.home() / ".cache" / "gradpatch" / name
