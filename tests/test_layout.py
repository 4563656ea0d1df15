"""The layout of the code base: small modules, no import cycles, layers gradpatch → editors → recipes → demos, no
package reading another's underscore names, a command line that answers ``--help`` without importing torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: The packages, lowest layer first: each may import only the ones before it.
LAYERS = ("gradpatch", "editors", "recipes", "demos")
MAX_LINES = 400


def _modules() -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (file, is a package ``__init__``) for every module of :data:`LAYERS` and benchmarks."""
    found: dict[str, tuple[Path, bool]] = {}
    for package in (*LAYERS, "benchmarks"):
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            found[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return found


MODULES = _modules()


def _imports(name: str) -> set[str]:
    """Our modules that module ``name`` imports anywhere (top level, inside functions, under TYPE_CHECKING)."""
    path, is_package = MODULES[name]
    targets: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = name.split(".") if is_package else name.split(".")[:-1]
                base_parts = base_parts[: len(base_parts) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            candidates = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            continue
        for target in candidates:
            while target and target not in MODULES:
                target = target.rpartition(".")[0]
            if target and target != name:
                targets.add(target)
    return targets


GRAPH = {name: _imports(name) for name in MODULES}


def test_no_module_is_longer_than_400_lines() -> None:
    long = {name: n for name, (path, _) in MODULES.items()
            if (n := len(path.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines (split them by job): {long}"


def test_no_import_cycles() -> None:
    """Tarjan's strongly connected components of the import graph: none larger than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = [stack.pop()]
            while component[-1] != v:
                component.append(stack.pop())
            if len(component) > 1:
                cycles.append(sorted(component))

    for name in GRAPH:
        if name not in index:
            visit(name)
    assert not cycles, f"import cycles: {cycles}"


def test_layers_import_only_lower_layers_and_never_the_command_line() -> None:
    wrong = []
    for name, targets in GRAPH.items():
        top = name.split(".")[0]
        if top not in LAYERS:
            continue
        for target in targets:
            other = target.split(".")[0]
            if other == "benchmarks" or LAYERS.index(other) > LAYERS.index(top):
                wrong.append(f"{name} -> {target}")
            if target.startswith("recipes.cli") and not name.startswith("recipes.cli"):
                wrong.append(f"{name} -> {target} (library code imports the command line)")
    assert not wrong, wrong


def _own_private_names(tree: ast.Module) -> set[str]:
    """Underscore names a module defines itself (``self._x = ...``, class fields ``_x: ...``, functions ``_f``)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
    return {n for n in names if n.startswith("_")}


@pytest.mark.parametrize("package", ["editors", "recipes", "demos", "benchmarks"])
def test_no_package_reads_another_packages_underscore_names(package: str) -> None:
    """Imports of ``_name`` from other modules, and ``obj._name`` reads of names the module does not define."""
    found = []
    for name, (path, _) in MODULES.items():
        if not name.startswith(package + ".") and name != package:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        own = _own_private_names(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                module = node.module.split(".")
                private = [a.name for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
                if module[0] in (*LAYERS, "benchmarks") and module[0] != package and (
                        private or any(part.startswith("_") and not part.startswith("__") for part in module)):
                    found.append(f"{path.name}:{node.lineno} from {node.module} import {private or '...'}")
            elif (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                  and node.attr not in own and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))):
                found.append(f"{path.name}:{node.lineno} {ast.unparse(node)}")
    assert not found, found


def test_the_command_line_builds_its_help_without_importing_torch() -> None:
    code = ("import sys\nfrom recipes.cli import build_parser\nparser = build_parser()\n"
            "for command in ('graph', 'rome', 'eval-rome', 'eval-edit', 'trace', 'attribute'):\n"
            "    try:\n        parser.parse_args([command, '--help'])\n    except SystemExit:\n        pass\n"
            "print(sorted(m for m in ('torch', 'transformers', 'lightning') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert result.stdout.strip().splitlines()[-1] == "[]"


def test_one_error_family_defined_in_the_errors_modules() -> None:
    """Every public exception class (warnings aside) is a ``GradpatchError`` defined in a package's ``errors``
    module."""
    import importlib

    from gradpatch.errors import GradpatchError

    elsewhere = []
    for name, (path, _) in MODULES.items():
        if name.endswith(".errors"):
            module = importlib.import_module(name)
            for value in vars(module).values():
                if (isinstance(value, type) and issubclass(value, BaseException) and not issubclass(value, Warning)
                        and value.__module__ == name):
                    assert issubclass(value, GradpatchError), f"{name}.{value.__name__} is not a GradpatchError"
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_") and any(
                    ast.unparse(base).endswith(("Error", "Exception")) for base in node.bases):
                elsewhere.append(f"{name}.{node.name}")
    assert not elsewhere, f"exception classes outside the errors modules: {elsewhere}"
