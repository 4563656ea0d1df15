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


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of ``graph`` larger than one node, each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
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

    for name in graph:
        if name not in index:
            visit(name)
    return cycles


def _collapsed(depth: int) -> dict[str, set[str]]:
    """The import graph with every module named by its first ``depth`` dotted parts (``editors.value.search`` is
    ``editors.value`` at depth 2): the graph of the packages at that level, self-imports dropped."""
    graph: dict[str, set[str]] = {}
    for name, targets in GRAPH.items():
        node = ".".join(name.split(".")[:depth])
        edges = graph.setdefault(node, set())
        edges.update(t for target in targets if (t := ".".join(target.split(".")[:depth])) != node)
    for targets in list(graph.values()):
        for target in targets:
            graph.setdefault(target, set())
    return graph


@pytest.mark.parametrize("depth", [1, 2, 3, None])
def test_no_import_cycles(depth: int | None) -> None:
    """No cycle among modules (``None``), nor among the packages and modules at each level of nesting (a module of
    ``editors.value`` importing ``editors.passes`` while one of ``editors.passes`` imports ``editors.value`` is a
    cycle at depth 2)."""
    cycles = _cycles(GRAPH if depth is None else _collapsed(depth))
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


#: At most this many modules directly under editors/ (the algorithms' front doors and what every room shares); the
#: rest lives in sub-packages by concern.
MAX_EDITORS_TOP_MODULES = 12


def test_editors_is_a_house_with_rooms() -> None:
    top = sorted(p.name for p in (ROOT / "editors").glob("*.py"))
    rooms = sorted(p.parent.name for p in (ROOT / "editors").glob("*/__init__.py"))
    assert len(top) <= MAX_EDITORS_TOP_MODULES, f"{len(top)} modules directly under editors/ (move some into a " \
                                                f"sub-package): {top}"
    assert len(rooms) >= 4, f"editors/ has {len(rooms)} sub-packages: {rooms}"


def _front_door_all(package: str) -> set[str]:
    """The ``__all__`` of a package front door, read from its ``__init__`` without importing it (a literal list, or
    ``sorted(_EXPORTS)`` over a literal dict)."""
    tree = ast.parse((ROOT / package.replace(".", "/") / "__init__.py").read_text(encoding="utf-8"))
    values: dict[str, ast.expr] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            values[node.targets[0].id] = node.value
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
            values[node.target.id] = node.value
    names = values["__all__"]
    if isinstance(names, ast.Call) and isinstance(names.args[0], ast.Name):  # sorted(_EXPORTS)
        names = values[names.args[0].id]
    return set(ast.literal_eval(names))


def test_recipes_import_editors_only_through_front_doors() -> None:
    """``recipes/`` reads ``editors`` only through ``editors`` or ``editors.<sub-package>`` and only names in their
    ``__all__``, so the rooms can be rearranged without touching the recipes."""
    doors = {"editors"} | {f"editors.{p.parent.name}" for p in (ROOT / "editors").glob("*/__init__.py")}
    wrong = []
    for name, (path, _) in MODULES.items():
        if not name.startswith("recipes"):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                wrong += [f"{name}: import {a.name}" for a in node.names
                          if a.name.split(".")[0] == "editors" and a.name not in doors]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("editors"):
                if node.module not in doors:
                    wrong.append(f"{name}: from {node.module} import ... (not a front door: {sorted(doors)})")
                    continue
                public = _front_door_all(node.module)
                wrong += [f"{name}: from {node.module} import {a.name} (not in its __all__)" for a in node.names
                          if a.name not in public]
    assert not wrong, wrong


def test_editors_front_doors_import_no_torch() -> None:
    """``import editors`` and ``import editors.<sub-package>`` stay cheap: their names load on first use."""
    rooms = sorted(p.parent.name for p in (ROOT / "editors").glob("*/__init__.py"))
    code = ("import sys\nimport editors\n" + "".join(f"import editors.{room}\n" for room in rooms)
            + "print('torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert result.stdout.strip().splitlines()[-1] == "False"


def test_one_model_layout_table() -> None:
    """Where a model family keeps its embeddings, blocks, norms and unembedding is written once, in
    ``gradpatch/layouts/``: no other module spells those NodePaths as string constants."""
    from gradpatch.layouts import LAYOUTS

    spelled = {value for layout in LAYOUTS.values()
               for value in (layout.embed, layout.layer, layout.logits_input, layout.final_norm)} | {
        f"{layout.final_norm}.{layout.norm_input}" for layout in LAYOUTS.values()}
    found = []
    for name, (path, _) in MODULES.items():
        if name == "gradpatch.layouts" or name.startswith("gradpatch.layouts."):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in spelled:
                found.append(f"{name}:{node.lineno} {node.value!r}")
    assert not found, f"model layouts written outside gradpatch/layouts/: {found}"


#: At most this many modules directly under recipes/ (what the rooms share); the rest lives in rooms by concern.
MAX_RECIPES_TOP_MODULES = 12
#: The rooms of recipes/, each a sub-package with a front door.
RECIPES_ROOMS = {"cli", "delta", "dictionary", "editing", "interchange", "reft", "reports", "training"}


def test_recipes_is_a_house_with_rooms() -> None:
    """A dozen modules at recipes/'s door, the rooms each behind a front door with an ``__all__``, every name of the
    door's ``__all__`` importable from it."""
    import importlib

    top = sorted(p.name for p in (ROOT / "recipes").glob("*.py"))
    rooms = {p.parent.name for p in (ROOT / "recipes").glob("*/__init__.py")}
    assert len(top) <= MAX_RECIPES_TOP_MODULES, f"{len(top)} modules directly under recipes/ (move some into a " \
                                                f"room): {top}"
    assert RECIPES_ROOMS <= rooms, f"recipes/ lacks the rooms {sorted(RECIPES_ROOMS - rooms)}"
    for package in ["recipes", *(f"recipes.{room}" for room in sorted(rooms - {"cli"}))]:
        module = importlib.import_module(package)
        names = _front_door_all(package)
        assert names, f"{package} has an empty __all__"
        missing = [name for name in sorted(names) if not hasattr(module, name)]
        assert not missing, f"{package}.__all__ names what it cannot give: {missing}"


def test_recipes_front_doors_import_no_torch() -> None:
    """``import recipes`` and ``import recipes.<room>`` stay cheap: their names load on first use."""
    code = ("import sys\nimport recipes\n" + "".join(f"import recipes.{room}\n" for room in sorted(RECIPES_ROOMS))
            + "print(sorted(m for m in ('torch', 'lightning') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert result.stdout.strip().splitlines()[-1] == "[]"


def test_the_intervention_modules_are_siblings_on_one_base() -> None:
    """DAS/interchange, delta and ReFT training share one base and none derives from another; none takes a method
    from another class to opt out of its parent's (``training_step = FrozenGraphModule.training_step``). An AddPatch
    delta's loss goes from Lightning's step (``recipes/training/frozen.py``) to ``pg.patch`` in
    ``recipes/delta/module.py``: with ``recipes/cli/fit.py``, three recipe modules (docs/architecture.md)."""
    from recipes import DeltaModule, InterventionModule, PatchTrainingModule, ReFTModule

    siblings = (DeltaModule, InterventionModule, ReFTModule)
    for module in siblings:
        assert module.__bases__ == (PatchTrainingModule,), f"{module.__name__} derives from {module.__bases__}"
    for name in ("recipes.delta.module", "recipes.interchange.module", "recipes.reft.module"):
        for node in ast.walk(ast.parse(MODULES[name][0].read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                borrowed = [ast.unparse(item) for item in node.body if isinstance(item, ast.Assign)
                            and isinstance(item.value, ast.Attribute) and isinstance(item.value.value, ast.Name)
                            and item.value.value.id[:1].isupper()]
                assert not borrowed, f"{name}.{node.name} borrows another class's method: {borrowed}"
    assert DeltaModule.training_step.__module__ == "recipes.training.frozen"
    assert DeltaModule.loss_terms.__module__ == "recipes.delta.module"


#: The rooms of gradpatch/ (issue 46): each behind a front door with an ``__all__``.
GRADPATCH_ROOMS = {"attribution", "circuits", "dictionaries", "extraction", "files", "interventions"}
MAX_GRADPATCH_TOP_MODULES = 15


def test_gradpatch_is_a_house_with_rooms() -> None:
    """At most 15 modules at gradpatch/'s door (``__init__`` included), the rooms each behind a front door whose
    ``__all__`` names only what it gives, and every name of ``gradpatch.__all__`` importable from ``gradpatch``."""
    import importlib

    top = sorted(p.name for p in (ROOT / "gradpatch").glob("*.py"))
    rooms = {p.parent.name for p in (ROOT / "gradpatch").glob("*/__init__.py")}
    assert len(top) <= MAX_GRADPATCH_TOP_MODULES, f"{len(top)} modules directly under gradpatch/ (move some into " \
                                                  f"a room): {top}"
    assert GRADPATCH_ROOMS <= rooms, f"gradpatch/ lacks the rooms {sorted(GRADPATCH_ROOMS - rooms)}"
    for package in ["gradpatch", *(f"gradpatch.{room}" for room in sorted(GRADPATCH_ROOMS))]:
        module = importlib.import_module(package)
        names = _front_door_all(package)
        assert names, f"{package} has an empty __all__"
        missing = [name for name in sorted(names) if not hasattr(module, name)]
        assert not missing, f"{package}.__all__ names what it cannot give: {missing}"


#: At most this many entries at benchmarks/'s door (README, __init__, the harness, data/, the rooms, peers/).
MAX_BENCHMARKS_DOOR = 12
#: The rooms of benchmarks/ (issue 61), each a package with a README that gives each script's command.
BENCHMARKS_ROOMS = {"engine", "editing", "attribution", "interventions", "dictionaries", "circuits", "graphpatch"}
#: Folders of one machine that no tracked benchmark file may name (a peer's Python comes from .peers/ or an option).
MACHINE_FOLDERS = tuple(f"/{name}/" for name in ("root", "work", "home"))


def test_benchmarks_is_a_house_with_rooms() -> None:
    """A dozen entries at benchmarks/'s door, only the harness there besides ``__init__``; every script in a room
    (each with a README naming its scripts), a peer's side script under ``peers/<peer>/`` beside the pinned
    ``requirements.txt``, or a data builder in ``data/``; no side script imports gradpatch, editors or recipes; no
    benchmark file names a folder of one machine."""
    door = sorted(p.name for p in (ROOT / "benchmarks").iterdir() if not p.name.startswith((".", "__pycache__")))
    assert len(door) <= MAX_BENCHMARKS_DOOR, f"{len(door)} entries at benchmarks/'s door (move some into a room): {door}"
    assert sorted(p.name for p in (ROOT / "benchmarks").glob("*.py")) == ["__init__.py", "harness.py"], door
    rooms = {p.parent.name for p in (ROOT / "benchmarks").glob("*/__init__.py")} - {"peers"}
    assert rooms == BENCHMARKS_ROOMS, f"benchmarks/'s rooms are {sorted(rooms)}, not {sorted(BENCHMARKS_ROOMS)}"
    for room in sorted(BENCHMARKS_ROOMS):
        readme = (ROOT / "benchmarks" / room / "README.md").read_text(encoding="utf-8")
        unnamed = [p.name for p in (ROOT / "benchmarks" / room).glob("*.py")
                   if p.name != "__init__.py" and f"`{p.name}`" not in readme]
        assert not unnamed, f"benchmarks/{room}/README.md does not name {unnamed}"
    homeless = [str(p.relative_to(ROOT)) for p in (ROOT / "benchmarks").rglob("*.py")
                if p.relative_to(ROOT / "benchmarks").parts[0] not in {*BENCHMARKS_ROOMS, "peers", "data"}
                and p.parent != ROOT / "benchmarks"]
    assert not homeless, f"benchmark scripts outside the rooms: {homeless}"
    misplaced = [str(p.relative_to(ROOT)) for p in (ROOT / "benchmarks").rglob("*_side.py")
                 if p.relative_to(ROOT / "benchmarks").parts[0] != "peers"]
    assert not misplaced, f"side scripts belong in benchmarks/peers/<peer>/: {misplaced}"
    for peer in (p for p in (ROOT / "benchmarks" / "peers").iterdir() if p.is_dir() and p.name != "__pycache__"):
        assert (peer / "requirements.txt").is_file(), f"benchmarks/peers/{peer.name} has no requirements.txt"
    leaking = [f"{name} -> {target}" for name, targets in GRAPH.items() if name.startswith("benchmarks.peers.")
               for target in targets if target.split(".")[0] in LAYERS]
    assert not leaking, f"peers' side scripts import the project (they run in the peer's virtualenv): {leaking}"
    tracked = subprocess.run(["git", "ls-files", "benchmarks"], cwd=ROOT, capture_output=True, text=True).stdout
    named = [f"{path}: {folder}" for path in tracked.split() if (ROOT / path).is_file()
             and path.endswith((".py", ".md", ".txt", ".sh"))
             for folder in MACHINE_FOLDERS if folder in (ROOT / path).read_text(encoding="utf-8", errors="replace")]
    assert not named, f"benchmark files naming a folder of one machine: {named}"


#: tests/'s rooms, mirroring the packages (the engine, its interventions, attribution, dictionaries and circuits in
#: gradpatch/; editors/; recipes/) and the reliability checks that cut across them.
TESTS_ROOMS = {"engine", "interventions", "attribution", "dictionaries", "circuits", "editors", "recipes",
               "reliability"}
MAX_TESTS_DOOR = 12


def test_tests_is_a_house_with_rooms() -> None:
    """A dozen entries at tests/'s door (the shared conftest and this file of the code base's own layout); every other
    test file in a room named after what it tests, each room holding tests."""
    door = sorted(p.name for p in (ROOT / "tests").iterdir() if not p.name.startswith((".", "__pycache__")))
    assert len(door) <= MAX_TESTS_DOOR, f"{len(door)} entries at tests/'s door (move some into a room): {door}"
    rooms = {p.name for p in (ROOT / "tests").iterdir() if p.is_dir() and not p.name.startswith((".", "__"))}
    assert rooms == TESTS_ROOMS, f"tests/'s rooms are {sorted(rooms)}, not {sorted(TESTS_ROOMS)}"
    assert sorted(p.name for p in (ROOT / "tests").glob("test_*.py")) == ["test_layout.py"], door
    empty = [room for room in sorted(TESTS_ROOMS) if not any((ROOT / "tests" / room).glob("test_*.py"))]
    assert not empty, f"rooms of tests/ without tests: {empty}"
    nested = [str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")
              if len(p.relative_to(ROOT).parts) > 3]
    assert not nested, f"test files below a room: {nested}"
