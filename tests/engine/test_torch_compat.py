"""Every private torch name the engine uses still exists (gradpatch/_torch_compat.py is the one place to mend)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from gradpatch._torch_compat import PRIVATE_SYMBOLS, TORCH_VERSION


@pytest.mark.parametrize("symbol", sorted(PRIVATE_SYMBOLS))
def test_private_torch_symbol_exists(symbol):
    try:
        PRIVATE_SYMBOLS[symbol]()
    except AttributeError as error:
        pytest.fail(f"torch {'.'.join(map(str, TORCH_VERSION))} no longer has {symbol} ({error}); mend the "
                    f"function using it in gradpatch/_torch_compat.py")


def _private(name: str) -> bool:
    return any(part.startswith("_") and not part.startswith("__") for part in name.split("."))


def _dotted(node: ast.AST) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return ".".join([node.id, *reversed(parts)]) if isinstance(node, ast.Name) else ""


def test_no_private_torch_name_outside_the_compat_module():
    engine = Path(__file__).resolve().parents[2] / "gradpatch"
    offenders = []
    for path in engine.rglob("*.py"):
        if path.name == "_torch_compat.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch"):
                names = [node.module or "", *(alias.name for alias in node.names)]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names if alias.name.startswith("torch")]
            elif isinstance(node, ast.Attribute) and _dotted(node).startswith("torch."):
                names = [_dotted(node)]
            else:
                continue
            offenders += [f"{path.name}:{node.lineno} {name}" for name in names if _private(name)]
    assert not offenders, offenders
