"""pytest plugin: ``import graphpatch`` (and its submodules) resolves to gradpatch.

This is the import plumbing for running graphpatch's own test suite against gradpatch
(``benchmarks/graphpatch_suite.py``). It changes imports only: every test runs unchanged.

graphpatch module paths map to the gradpatch module holding the same names (table below). A name that gradpatch
does not have (graphpatch internals such as ``graphpatch.meta.GraphMeta`` or ``graphpatch.extraction.extract``)
resolves to a stand-in class, so that the test modules importing it can be collected; using the stand-in raises
``NotImplementedError``, so a test that needs the internal fails rather than passes.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any

#: graphpatch module (or package prefix) -> gradpatch module. Longest prefix wins.
MODULE_MAP = {
    "graphpatch": "gradpatch",
    "graphpatch.patchable_graph": "gradpatch.patchable_graph",
    "graphpatch.patch": "gradpatch.patches",
    "graphpatch.exceptions": "gradpatch.errors",
    "graphpatch.extraction": "gradpatch.extraction",
    "graphpatch.meta": "",  # graphpatch's tree internals (GraphMeta, NodeData[...]): stand-ins only
    "graphpatch.hacks": "gradpatch._torch_compat",
    "graphpatch.optional": "gradpatch.optional",
    "graphpatch.optional.dataclasses": "dataclasses",  # graphpatch's backport of the standard library's
    "graphpatch.optional.accelerate": "gradpatch.optional.accelerate",
    "graphpatch.optional.bitsandbytes": "gradpatch.optional.bitsandbytes",
    "graphpatch.optional.transformers": "gradpatch.optional.transformers",
    "graphpatch.optional.transformer_lens": "gradpatch.optional.transformer_lens",
}

#: Names looked up on an alias that gradpatch lacks, as "graphpatch.module.Name" (reported by the suite runner).
MISSING: set[str] = set()


def _target(name: str) -> str:
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        prefix = ".".join(parts[:end])
        if prefix in MODULE_MAP:
            return MODULE_MAP[prefix]
    raise KeyError(name)


def _stand_in(qualified: str) -> type:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{qualified} is a graphpatch internal with no gradpatch equivalent")

    namespace = {"__init__": refuse, "__call__": refuse, "__module__": qualified.rsplit(".", 1)[0],
                 "__class_getitem__": classmethod(lambda cls, item: cls)}  # NodeData[int] in annotations
    return type(qualified.rsplit(".", 1)[-1], (), namespace)


class _Alias(types.ModuleType):
    """A graphpatch module name whose attributes come from a gradpatch module (``None``: stand-ins only)."""

    def __init__(self, name: str, target: types.ModuleType | None) -> None:
        super().__init__(name)
        self.__path__: list[str] = []  # a package: graphpatch.x.y imports go through the finder
        self._gp_target = target

    def __getattr__(self, attribute: str) -> Any:
        if attribute.startswith("__"):
            raise AttributeError(attribute)
        submodule = f"{self.__name__}.{attribute}"
        if submodule in MODULE_MAP:  # `from graphpatch.optional import accelerate`
            return importlib.import_module(submodule)
        try:
            return getattr(self._gp_target, attribute)
        except AttributeError:
            qualified = f"{self.__name__}.{attribute}"
            MISSING.add(qualified)
            stand_in = _stand_in(qualified)
            setattr(self, attribute, stand_in)
            return stand_in


class _Loader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        target = _target(spec.name)
        return _Alias(spec.name, importlib.import_module(target) if target else None)

    def exec_module(self, module: types.ModuleType) -> None:
        return None


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name != "graphpatch" and not name.startswith("graphpatch."):
            return None
        return importlib.machinery.ModuleSpec(name, _Loader(), is_package=True)


sys.meta_path.insert(0, _Finder())
