"""pytest plugin: ``import graphpatch`` (and its submodules) resolves to gradpatch.

This is the import plumbing for running graphpatch's own test suite against gradpatch
(``benchmarks/graphpatch/suite.py``). It changes imports, and three details of graphpatch's test set-up (below):
every test runs unchanged.

graphpatch module paths map to the gradpatch module holding the same names (table below). A name that gradpatch
does not have (graphpatch internals such as ``graphpatch.meta.GraphMeta`` or ``graphpatch.extraction.extract``)
resolves to a stand-in class, so that the test modules importing it can be collected; using the stand-in raises
``NotImplementedError``, so a test that needs the internal fails rather than passes.

Three adjustments let graphpatch's fixtures run on the library versions the project pins (``constraints.txt``); none
touches gradpatch or what a test asserts:

- ``graphpatch.optional.transformers.PreTrainedModel`` is a subclass (``PostInitPreTrainedModel``): graphpatch's
  ``TestModel`` never calls ``post_init()``, which transformers 5 requires of every model (``from_pretrained`` reads
  the ``all_tied_weights_keys`` it sets), so the subclass calls it after the model's own ``__init__``; and
  ``graphpatch.optional.transformers.PretrainedConfig`` is a subclass (``LegacyGenerationPretrainedConfig``) that
  keeps the generation parameters a config is given (``TestModelConfig``'s ``max_length=110``), which transformers 5
  drops from model configs; the model subclass makes them the model's ``generation_config``, where transformers 5
  keeps them.
- pytest 8.4 replaced ``FixtureManager._arg2fixturedefs``, which graphpatch's ``all_patchable_graphs`` fixture reads
  (``test_patchable_graph_graph_repr``); :func:`_restore_arg2fixturedefs` gives it back, computed from its replacement.
"""

from __future__ import annotations

import functools
import importlib
import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any, Callable

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

#: Harness replacements of names in an aliased module (see the module docstring), built on first use.
OVERRIDES: dict[str, Callable[[], Any]] = {
    "graphpatch.optional.transformers.PreTrainedModel": lambda: _post_init_pretrained_model(),
    "graphpatch.optional.transformers.PretrainedConfig": lambda: _legacy_generation_config(),
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
        if submodule in OVERRIDES:
            value = OVERRIDES[submodule]()
            setattr(self, attribute, value)
            return value
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


#: Attribute of a ``LegacyGenerationPretrainedConfig`` holding the generation parameters it was given.
LEGACY_GENERATION = "legacy_generation_parameters"


@functools.lru_cache(maxsize=None)
def _legacy_generation_config() -> type:
    from transformers import GenerationConfig, PretrainedConfig

    names = set(GenerationConfig().to_dict()) - {"use_cache", "transformers_version"}

    class LegacyGenerationPretrainedConfig(PretrainedConfig):
        """transformers' ``PretrainedConfig`` that keeps the generation parameters it is given (``max_length``...)
        in :data:`LEGACY_GENERATION` instead of dropping them, as configs of transformers 4 did."""

        def __init__(self, **kwargs: Any) -> None:
            kept = kwargs.pop(LEGACY_GENERATION, None) or {}
            super().__init__(**kwargs)
            kept.update({name: kwargs[name] for name in names & set(kwargs) if not hasattr(self, name)})  # dropped
            setattr(self, LEGACY_GENERATION, kept)

    LegacyGenerationPretrainedConfig.__name__ = LegacyGenerationPretrainedConfig.__qualname__ = "PretrainedConfig"
    return LegacyGenerationPretrainedConfig


@functools.lru_cache(maxsize=None)
def _post_init_pretrained_model() -> type:
    from transformers import GenerationConfig, PreTrainedModel

    class PostInitPreTrainedModel(PreTrainedModel):
        """transformers' ``PreTrainedModel`` for model classes written before ``post_init()`` was required: a subclass
        that defines ``__init__`` without calling it gets it called once its ``__init__`` returns, and a config's
        kept generation parameters become the model's ``generation_config`` when it has none."""

        def __init_subclass__(cls, **kwargs: Any) -> None:
            super().__init_subclass__(**kwargs)
            own_init = cls.__dict__.get("__init__")
            if own_init is None:
                return

            @functools.wraps(own_init)
            def init(self: Any, *args: Any, **init_kwargs: Any) -> None:
                own_init(self, *args, **init_kwargs)
                if type(self) is not cls:
                    return
                if "all_tied_weights_keys" not in self.__dict__:
                    self.post_init()
                legacy = getattr(self.config, LEGACY_GENERATION, None)
                if legacy and getattr(self, "generation_config", None) is None:
                    self.generation_config = GenerationConfig(**legacy)

            cls.__init__ = init  # type: ignore[misc]

    PostInitPreTrainedModel.__name__ = PostInitPreTrainedModel.__qualname__ = "PreTrainedModel"
    return PostInitPreTrainedModel


def _restore_arg2fixturedefs() -> None:
    """Give pytest ≥ 8.4's ``FixtureManager`` back the ``_arg2fixturedefs`` mapping (fixture name -> definitions)
    that graphpatch's ``all_patchable_graphs`` fixture reads; where pytest still sets it, its own value is kept."""
    from _pytest.fixtures import FixtureManager

    def get(self: Any) -> dict[str, list[Any]]:
        if "_gp_arg2fixturedefs" in self.__dict__:  # pytest < 8.4 assigned its own
            return self.__dict__["_gp_arg2fixturedefs"]
        by_node = getattr(self, "_arg2node2fixturedefs", {})
        return {name: [definition for definitions in nodes.values() for definition in definitions]
                for name, nodes in by_node.items()}

    def set_(self: Any, value: dict[str, list[Any]]) -> None:
        self.__dict__["_gp_arg2fixturedefs"] = value

    FixtureManager._arg2fixturedefs = property(get, set_)  # type: ignore[attr-defined]


sys.meta_path.insert(0, _Finder())
_restore_arg2fixturedefs()
