"""Run graphpatch's own test suite against gradpatch, with only the import changed, and print JSON counts.

graphpatch's tests are the compatibility spec of gradpatch's public API. This script runs them unchanged from a
checkout of github.com/evan-lloyd/graphpatch, with ``import graphpatch`` (and its submodules) resolved to gradpatch
by the pytest plugin ``benchmarks/graphpatch_alias.py``; it changes imports only.

Set-up, outside the project's dependencies. graphpatch's fixtures need the library versions of its time:
its test model is a ``PreTrainedModel`` without ``post_init()`` that expects to inherit ``generate`` (transformers
before 4.50), and its fixture collection reads pytest internals removed in pytest 8.4::

    python -m venv /tmp/gpvenv
    /tmp/gpvenv/bin/pip install torch==2.13.0 "transformers==4.46.3" accelerate safetensors tqdm pyyaml \\
        "syrupy==4.8.1" "pytest==8.3.5" pytest-mock "pytest-env<1.2" sentencepiece protobuf
    /tmp/gpvenv/bin/pip install --no-deps -e .
    python benchmarks/graphpatch_suite.py --graphpatch /path/to/graphpatch --python /tmp/gpvenv/bin/python

Classification of the collected tests (printed with each failure's first line):

- ``internal``: tests of graphpatch internals that have no gradpatch counterpart (``graphpatch.meta``'s
  tree classes and ``pg._meta``, ``graphpatch.extraction.extract``, the 8-bit wrapper class, the tox check);
- ``pickle``: round trips through ``pg.save()`` + ``torch.load()``, i.e. pickle, which gradpatch refuses
  (``torch.save(pg)`` raises; ``pg.save``/``PatchableGraph.load`` write safetensors + JSON);
- ``snapshot``: exact ``repr`` snapshots of graphs whose node names come from torch.compile's naming;
- ``public``: everything else — the target counts these.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ElementTree
from pathlib import Path

HERE = Path(__file__).resolve().parent
INTERNAL_FILES = {"test_extraction.py", "test_meta.py", "test_quantization.py", "test_validate_env.py"}
INTERNAL_TESTS = {
    "test_node_path.py::test_wrap_node_path", "test_node_path.py::test_node_path_autocomplete",
    "test_node_path.py::test_protected_names",  # graphpatch.meta's WrappedCode/NodeShapePath, pg._meta
    "test_real_models.py::test_extract_llama", "test_real_models.py::test_extract_gpt2",  # extraction.extract
}
SNAPSHOT_TESTS = {"test_node_path.py::test_patchable_graph_graph_repr", "test_node_path.py::test_node_path_code"}


def category(file: str, name: str) -> str:
    """``internal``, ``pickle``, ``snapshot`` or ``public`` for test ``name`` (parameters included) in ``file``."""
    base = f"{file}::{name.split('[')[0]}"
    if file in INTERNAL_FILES or base in INTERNAL_TESTS:
        return "internal"
    if base in SNAPSHOT_TESTS:
        return "snapshot"
    if file == "test_serialization.py" and not name.startswith("test_torch_save_raises"):
        return "pickle"
    return "public"


def run(graphpatch: Path, python: str) -> dict[str, object]:
    """Run the suite and return the counts by category and outcome, with the failures of each category."""
    with tempfile.TemporaryDirectory() as scratch:
        report = Path(scratch) / "report.xml"
        env = {**os.environ, "PYTHONPATH": f"{HERE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        subprocess.run([python, "-m", "pytest", "-p", "graphpatch_alias", "-p", "no:cacheprovider", "-q",
                        "--tb=line", f"--junitxml={report}", "tests"], cwd=graphpatch, env=env,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
        cases = ElementTree.parse(report).getroot().iter("testcase")
        results: dict[str, dict[str, object]] = {}
        for case in cases:
            file = case.get("classname", "").split(".")[-1] + ".py"
            name = case.get("name", "")
            kind = category(file, name)
            entry = results.setdefault(kind, {"passed": 0, "failed": 0, "skipped": 0, "failures": {}})
            problem = next((child for child in case if child.tag in ("failure", "error")), None)
            if problem is not None:
                entry["failed"] += 1  # type: ignore[operator]
                message = (problem.get("message") or problem.text or "").strip().splitlines()
                entry["failures"][f"{file}::{name}"] = message[0][:200] if message else ""  # type: ignore[index]
            elif any(child.tag == "skipped" for child in case):
                entry["skipped"] += 1  # type: ignore[operator]
            else:
                entry["passed"] += 1  # type: ignore[operator]
    public = results.get("public", {"passed": 0, "failed": 0})
    runnable = int(public["passed"]) + int(public["failed"])  # type: ignore[call-overload]
    return {"public_pass_rate": round(int(public["passed"]) / runnable, 3) if runnable else None,  # type: ignore
            "by_category": results}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--graphpatch", type=Path, required=True, help="a checkout of graphpatch (holding tests/)")
    parser.add_argument("--python", default=sys.executable, help="the interpreter of the environment to test in")
    arguments = parser.parse_args()
    print(json.dumps(run(arguments.graphpatch.resolve(), arguments.python), indent=2))


if __name__ == "__main__":
    main()
