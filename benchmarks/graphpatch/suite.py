"""Run graphpatch's own test suite against gradpatch, with imports redirected, and print JSON counts per category.

graphpatch's tests are the compatibility spec of gradpatch's public API. This script runs them from graphpatch's
repository (a checkout, or a git directory whose HEAD it archives), with ``import graphpatch`` (and its submodules)
resolved to gradpatch by the pytest plugin ``benchmarks/graphpatch/alias.py``, which also adapts three things of
graphpatch's test set-up to transformers 5 and pytest ≥ 8.4 (see its docstring). No test is edited.

Set-up: a virtualenv made from the project's pins (``constraints.txt``) with the ``graphpatch-suite`` extra, i.e.
graphpatch's test libraries (syrupy, pytest-mock, pytest-env, sentencepiece, protobuf) besides transformers and
accelerate (``benchmarks/peers/graphpatch/requirements.txt``); the tests run in it (``--python`` names another)::

    make peers PEERS=graphpatch        # .peers/graphpatch
    .venv/bin/python -m benchmarks.graphpatch.suite --graphpatch PATH

bitsandbytes is left out on a machine without a GPU: graphpatch's fixtures move 8-bit layers to CUDA whenever
bitsandbytes imports, so with it installed there, fixtures shared by every ``repr`` snapshot fail.

Categories (each test in one; the counts are passed / failed / skipped, with the failing tests listed):

- ``internal``: tests of graphpatch internals with no gradpatch counterpart (``graphpatch.meta``'s tree classes
  and ``pg._meta``, ``graphpatch.extraction.extract``, the 8-bit wrapper class, the tox check);
- ``pickle``: round trips through ``pg.save()`` + ``torch.load()``, i.e. pickle, which gradpatch refuses
  (``torch.save(pg)`` raises; ``pg.save``/``PatchableGraph.load`` write safetensors + JSON);
- ``snapshot``: exact ``repr``/``_code`` snapshots of graphs whose node names come from torch.compile's numbering;
- ``gpu_only``: tests skipped here because they need CUDA (graphpatch's ``requires_gpu``/``requires_multi_gpu``) or
  bitsandbytes, whose fixtures need CUDA;
- ``public``: everything else; ``public.pass_rate`` is passed / (passed + failed), the target.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import subprocess
import tarfile
import tempfile
import xml.etree.ElementTree as ElementTree
from pathlib import Path
from typing import Any

from benchmarks.graphpatch import snapshots
from benchmarks.harness import ROOT, emit, peer_python

HERE = Path(__file__).resolve().parent
CONSTRAINTS = ROOT / "constraints.txt"
#: What the runner needs of a graphpatch checkout.
CHECKOUT_PATHS = ("tests", "demos", "pytest.ini")
INTERNAL_FILES = {"test_extraction.py", "test_meta.py", "test_quantization.py", "test_validate_env.py"}
INTERNAL_TESTS = {
    "test_node_path.py::test_wrap_node_path", "test_node_path.py::test_node_path_autocomplete",
    "test_node_path.py::test_protected_names",  # graphpatch.meta's WrappedCode/NodeShapePath, pg._meta
    "test_real_models.py::test_extract_llama", "test_real_models.py::test_extract_gpt2",  # extraction.extract
}
SNAPSHOT_TESTS = {"test_node_path.py::test_patchable_graph_graph_repr", "test_node_path.py::test_node_path_code"}
#: Skip reasons that mean "needs a GPU" (graphpatch's requires_gpu, requires_multi_gpu, requires_bitsandbytes).
GPU_SKIP_WORDS = ("CUDA", "bitsandbytes")
#: Characters kept of each failure's first message line.
MESSAGE_LENGTH = 150
#: Distributions whose versions the report shows (besides those pinned in constraints.txt).
REPORTED = ("torch", "syrupy", "pytest-mock", "pytest-env", "sentencepiece", "protobuf", "gradpatch")


def category(file: str, name: str, skip_reason: str | None) -> str:
    """The category (see the module docstring) of test ``name`` (parameters included) in ``file``."""
    base = f"{file}::{name.split('[')[0]}"
    if skip_reason is not None and any(word in skip_reason for word in GPU_SKIP_WORDS):
        return "gpu_only"
    if file in INTERNAL_FILES or base in INTERNAL_TESTS:
        return "internal"
    if base in SNAPSHOT_TESTS:
        return "snapshot"
    if file == "test_serialization.py" and not name.startswith("test_torch_save_raises"):
        return "pickle"
    return "public"


def prepare(source: Path, scratch: Path) -> str | None:
    """Copy graphpatch's tests, demos and pytest.ini from ``source`` into ``scratch / "graphpatch"``; return
    graphpatch's commit when ``source`` is a git directory (its HEAD is archived), ``None`` for a checkout.

    Raises:
        SystemExit: ``source`` is neither a checkout holding tests/ nor a git directory.
    """
    checkout = scratch / "graphpatch"
    if (source / "tests").is_dir():
        for name in CHECKOUT_PATHS:
            if (source / name).is_dir():
                shutil.copytree(source / name, checkout / name)
            elif (source / name).exists():
                shutil.copy2(source / name, checkout / name)
        return None
    try:
        commit = subprocess.run(["git", "--git-dir", str(source), "rev-parse", "HEAD"], check=True,
                                capture_output=True, text=True).stdout.strip()
        archive = subprocess.run(["git", "--git-dir", str(source), "archive", "--format=tar", commit,
                                  *CHECKOUT_PATHS], check=True, capture_output=True).stdout
    except (OSError, subprocess.CalledProcessError) as error:
        raise SystemExit(f"--graphpatch {source}: neither a checkout holding tests/ nor a git directory of "
                         f"graphpatch ({error}); clone https://github.com/evan-lloyd/graphpatch and pass its path")
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        if hasattr(tarfile, "data_filter"):  # Python 3.10.12+, 3.11.4+
            tar.extractall(checkout, filter="data")
        else:  # pragma: no cover - older patch releases
            tar.extractall(checkout)
    return commit


def versions(python: str) -> dict[str, str | None]:
    """Installed versions, in the environment of ``python``, of the pinned and the reported distributions."""
    names = [*pins(), *REPORTED]
    script = ("import importlib.metadata as m, json, sys\n"
              "def v(n):\n    try:\n        return m.version(n)\n    except m.PackageNotFoundError:\n        return None\n"
              "print(json.dumps({n: v(n) for n in sys.argv[1:]}))")
    result = subprocess.run([python, "-c", script, *names], check=True, capture_output=True, text=True)
    return json.loads(result.stdout)


def pins() -> dict[str, str]:
    """``name -> version`` of the ``name==version`` lines of constraints.txt."""
    pinned = {}
    for line in CONSTRAINTS.read_text().splitlines():
        name, sep, version = line.split("#")[0].strip().partition("==")
        if sep:
            pinned[name.strip()] = version.strip()
    return pinned


def run_pytest(checkout: Path, python: str, scratch: Path, tests: str = "tests",
               env: dict[str, str] | None = None) -> ElementTree.Element:
    """Run pytest on ``tests`` in ``checkout`` with the alias plugin and return its JUnit XML report."""
    report = scratch / "report.xml"
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    subprocess.run([python, "-m", "pytest", "-p", "benchmarks.graphpatch.alias", "-p", "no:cacheprovider", "-q",
                    "--tb=line", f"--basetemp={scratch / 'pytest'}", f"--junitxml={report}", tests], cwd=checkout,
                   env={**os.environ, "PYTHONPATH": path, **(env or {})},
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
    if not report.exists():
        raise SystemExit(f"pytest wrote no report: run it by hand in {checkout} to see why")
    return ElementTree.parse(report).getroot()


def snapshot_verdicts(checkout: Path, python: str, scratch: Path) -> dict[str, str]:
    """How each graph's ``repr`` differs from graphpatch's snapshot (:mod:`benchmarks.graphpatch.snapshots`), run
    after the suite as one more test module in ``checkout``."""
    verdicts = scratch / "snapshots.json"
    shutil.copy2(HERE / "snapshots.py", checkout / "tests" / "test_gradpatch_snapshot_verdicts.py")
    run_pytest(checkout, python, scratch, "tests/test_gradpatch_snapshot_verdicts.py",
               {snapshots.REPORT_VARIABLE: str(verdicts)})
    return json.loads(verdicts.read_text()) if verdicts.exists() else {}


def tally(report: ElementTree.Element) -> dict[str, dict[str, Any]]:
    """Counts per category and outcome, with each failing test's first message line and each skip reason."""
    results: dict[str, dict[str, Any]] = {}
    for case in report.iter("testcase"):
        file = case.get("classname", "").split(".")[-1] + ".py"
        name = case.get("name", "")
        problem = next((child for child in case if child.tag in ("failure", "error")), None)
        skip = next((child for child in case if child.tag == "skipped"), None)
        skip_reason = None if skip is None else (skip.get("message") or "").strip()
        kind = category(file, name, skip_reason)
        entry = results.setdefault(kind, {"passed": 0, "failed": 0, "skipped": 0, "failures": {}, "skips": {}})
        if problem is not None:
            entry["failed"] += 1
            message = (problem.get("message") or problem.text or "").strip().splitlines()
            entry["failures"][f"{file}::{name}"] = message[0][:MESSAGE_LENGTH] if message else ""
        elif skip_reason is not None:
            entry["skipped"] += 1
            entry["skips"][skip_reason] = entry["skips"].get(skip_reason, 0) + 1
        else:
            entry["passed"] += 1
    return results


def run(source: Path, python: str) -> dict[str, Any]:
    """Run the suite from graphpatch ``source`` with interpreter ``python`` and return the report (module
    docstring)."""
    with tempfile.TemporaryDirectory() as directory:
        scratch = Path(directory)
        commit = prepare(source, scratch)
        checkout = scratch / "graphpatch"
        results = tally(run_pytest(checkout, python, scratch))
        verdicts = snapshot_verdicts(checkout, python, scratch)
    installed = versions(python)
    off_pins = {name: {"pinned": version, "installed": installed.get(name)}
                for name, version in pins().items() if installed.get(name) not in (None, version)}
    public = results.get("public", {"passed": 0, "failed": 0, "skipped": 0})
    runnable = public["passed"] + public["failed"]
    return {
        "graphpatch": {"source": str(source), "commit": commit},
        "versions": {name: version for name, version in installed.items() if version is not None},
        "off_pins": off_pins,
        "public": {"passed": public["passed"], "runnable": runnable, "skipped": public["skipped"],
                   "pass_rate": round(public["passed"] / runnable, 3) if runnable else None},
        "counts": {kind: {outcome: entry[outcome] for outcome in ("passed", "failed", "skipped")}
                   for kind, entry in sorted(results.items())},
        "failing": {kind: _by_message(entry["failures"]) for kind, entry in sorted(results.items())
                    if entry["failures"]},
        "skipped": {kind: entry["skips"] for kind, entry in sorted(results.items()) if entry["skips"]},
        "snapshot_verdicts": {verdict: sorted(name for name, said in verdicts.items() if said == verdict)
                              for verdict in sorted(set(verdicts.values()))},
    }


def _by_message(failures: dict[str, str]) -> dict[str, list[str]]:
    """``first message line -> failing tests`` (tests sharing a cause are listed together)."""
    grouped: dict[str, list[str]] = {}
    for test, message in failures.items():
        grouped.setdefault(message, []).append(test)
    return grouped


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--graphpatch", type=Path, required=True,
                        help="graphpatch's repository: a checkout holding tests/, or a git directory (HEAD is used)")
    parser.add_argument("--python", help="the interpreter of the environment to test in (default: "
                                         ".peers/graphpatch/bin/python)")
    arguments = parser.parse_args()
    emit(run(arguments.graphpatch.resolve(), peer_python("graphpatch", arguments.python)))


if __name__ == "__main__":
    main()
