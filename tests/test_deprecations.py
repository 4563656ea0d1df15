"""Renamed public names: the old name still works for one release and warns once per process (a fresh interpreter
per check, so no earlier use has warned already)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHECK = """
import warnings
warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as caught:
{body}
messages = [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]
print(repr(messages))
"""


def _deprecations(body: str) -> list[str]:
    """The DeprecationWarning messages that ``body`` (indented into a ``with`` block) raises in a fresh Python."""
    code = CHECK.format(body="\n".join("    " + line for line in body.strip().splitlines()))
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    return eval(result.stdout.strip().splitlines()[-1])  # a list of str literals, printed above


def test_second_moment_node_is_input_node_and_warns_once() -> None:
    messages = _deprecations("""
import torch
from editors.statistics import SecondMoment
m = SecondMoment(matrix=torch.eye(2), n_tokens=3, n_samples=1, input_node="a.b.input", fingerprint="f", corpus=None)
assert m.node == "a.b.input" and m.node == m.input_node
""")
    assert messages == ["SecondMoment.node is deprecated (it goes in the next release): use SecondMoment.input_node"]


def test_renamed_engine_modules_still_import_and_warn_once() -> None:
    messages = _deprecations("""
import gradpatch.loaders, gradpatch.patch_table, gradpatch.value_info
import gradpatch.models, gradpatch.patching, gradpatch.values
import gradpatch.models, gradpatch.patching, gradpatch.values
from gradpatch.models import load_model
from gradpatch.patching import apply_patches
from gradpatch.values import ValueInfo
assert (load_model, apply_patches, ValueInfo) == (gradpatch.loaders.load_model, gradpatch.patch_table.apply_patches,
                                                  gradpatch.value_info.ValueInfo)
for old, new in ((gradpatch.models, gradpatch.loaders), (gradpatch.patching, gradpatch.patch_table),
                 (gradpatch.values, gradpatch.value_info)):
    assert old.__all__ == new.__all__ and all(getattr(old, n) is getattr(new, n) for n in new.__all__)
""")
    assert messages == [f"gradpatch.{old} is deprecated (it goes in the next release): use gradpatch.{new}"
                        for old, new in (("models", "loaders"), ("patching", "patch_table"), ("values", "value_info"))]
