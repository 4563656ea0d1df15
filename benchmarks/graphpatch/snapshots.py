"""Compare gradpatch's ``repr(pg.graph)`` with graphpatch's snapshots, graph by graph, and say how each differs.

graphpatch's ``test_patchable_graph_graph_repr`` stops at the first graph whose tree drawing differs from its
snapshot. ``benchmarks/graphpatch/suite.py`` copies this file into the tests/ folder of the graphpatch checkout it
runs and runs it as one more test module, with graphpatch's own fixtures (``all_patchable_graphs``); the test writes,
to the JSON file named by ``GRADPATCH_SNAPSHOT_REPORT``, one verdict per fixture graph and mode (``compiled``,
``opaque``) from :func:`compare`:

- ``identical``;
- ``numbered names only``: equal once every trailing number in a node name is blanked (``add_1`` vs ``add_2``:
  torch.compile numbers nodes differently from gradpatch's tracer; see docs/engine.md);
- ``differs: <first differing line pair>`` otherwise.

The same verdict is given for ``pg.graph._code`` (``pg.graph.code``) of the deeply nested output module against graphpatch's
``test_node_path_code`` snapshot (key ``..._code[compiled]``).

It needs pytest and graphpatch's fixtures; it is not a test of gradpatch's own suite.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

#: Environment variable naming the JSON file the verdicts go to.
REPORT_VARIABLE = "GRADPATCH_SNAPSHOT_REPORT"
_NUMBER = re.compile(r"(?<=[A-Za-z])_\d+\b")


def compare(received: str, expected: str) -> str:
    """``identical``, ``numbered names only`` or ``differs: ...`` for two tree drawings (see the module docstring)."""
    if received == expected:
        return "identical"
    if _NUMBER.sub("", received) == _NUMBER.sub("", expected):
        return "numbered names only"
    ours, theirs = received.splitlines(), expected.splitlines()
    for line, (mine, snapshot) in enumerate(zip(ours, theirs)):
        if _NUMBER.sub("", mine) != _NUMBER.sub("", snapshot):
            return f"differs: line {line + 1}: gradpatch {mine.strip()!r}, graphpatch {snapshot.strip()!r}"
    return f"differs: {len(ours)} lines, graphpatch {len(theirs)}"


def snapshot_text(path: Path) -> str:
    """The drawing stored in a syrupy single-file snapshot (``.ambr``: the text between ``'''`` lines)."""
    text = path.read_text()
    return text.split("'''\n", 1)[1].rsplit("\n'''", 1)[0] if "'''" in text else text.strip()


def amber_entry(path: Path, name: str) -> str | None:
    """The value stored under ``# name: <name>`` in a syrupy ``.ambr`` file (its lines indented by two spaces)."""
    entries = path.read_text().split("# name: ")
    for entry in entries[1:]:
        title, _, body = entry.partition("\n")
        if title.strip() == name:
            lines = body.split("\n# ---")[0].splitlines()
            return "\n".join(line[2:] for line in lines)
    return None


def snapshot_file(folder: Path, name: str, compiled: bool) -> Path | None:
    """graphpatch's snapshot of fixture ``name``: for compiled graphs, the newest torch's (``_2_5``)."""
    path = folder / f"{name}{'_2_5' if compiled else ''}.ambr"
    return path if path.exists() else None


try:
    import pytest
except ImportError:  # pragma: no cover - only imported by pytest inside graphpatch's checkout
    pytest = None

if pytest is not None and os.environ.get(REPORT_VARIABLE):

    @pytest.mark.parametrize("all_patchable_graphs", ["compiled", "opaque"], indirect=True)
    def test_snapshot_differences(all_patchable_graphs: dict[str, Any], request: Any) -> None:
        mode = "compiled" if "compiled" in request.node.name else "opaque"
        folder = Path(__file__).parent / "__snapshots__" / "test_node_path" / (
            f"test_patchable_graph_graph_repr[{mode}]")
        report = Path(os.environ[REPORT_VARIABLE])
        verdicts = json.loads(report.read_text()) if report.exists() else {}
        for name, pg in all_patchable_graphs.items():
            path = snapshot_file(folder, name, mode == "compiled")
            verdict = "no snapshot" if path is None else compare(repr(pg.graph), snapshot_text(path))
            verdicts[f"{name}[{mode}]"] = verdict
        nested = all_patchable_graphs.get("patchable_deeply_nested_output_module")
        code = amber_entry(folder.parent.parent / "test_node_path.ambr", "test_node_path_code[2_1]")
        if mode == "compiled" and nested is not None and code is not None:
            verdicts[f"patchable_deeply_nested_output_module._code[{mode}]"] = compare(nested.graph.code, code)
        report.write_text(json.dumps(verdicts, indent=1))
