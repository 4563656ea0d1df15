"""The editing methods by name, so a caller that takes the method as an option (``gradpatch eval-edit --method``)
has no branch per method::

    config = config_for("memit", mom2_update_weight=5000.0)     # checked before the model is loaded
    editor = editor_for("memit", pg, tokenizer, nodes, config)
    result = evaluate_sequential(pg, editor.tokenizer, cases, editor.applier(), batch_size=100,
                                 after_group=editor.forget)
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import Any

from torch import nn

from .alphaedit import AlphaEdit, AlphaEditConfig
from .config import MEMITConfig, ROMEConfig
from .defaults import METHODS
from .editor import Editor
from .memit import MEMIT
from .rome import ROME
from .statistics.corpus import Corpus

__all__ = ["config_for", "editor_for"]

#: Method name (:data:`editors.defaults.METHODS`) -> (editor class, configuration class).
_METHODS: dict[str, tuple[type[Editor], type[ROMEConfig]]] = dict(zip(METHODS, [
    (ROME, ROMEConfig), (MEMIT, MEMITConfig), (AlphaEdit, AlphaEditConfig)]))


def _classes(method: str) -> tuple[type[Editor], type[ROMEConfig]]:
    """The editor and configuration classes of ``method``; ``ValueError`` naming the methods if it is unknown."""
    if method not in _METHODS:
        raise ValueError(f"Unknown editing method {method!r}; pick one of {', '.join(METHODS)}")
    return _METHODS[method]


def config_for(method: str, **settings: Any) -> ROMEConfig:
    """The configuration of ``method`` with ``settings`` (the other fields keep their defaults): built before the
    model is loaded, so a bad setting fails first.

    Args:
        method: one of :data:`METHODS`.
        settings: fields of the method's configuration (:class:`~editors.ROMEConfig`, :class:`~editors.MEMITConfig`,
            :class:`~editors.alphaedit.AlphaEditConfig`).

    Raises:
        ValueError: an unknown method, a setting the method's configuration does not have (the message names the
            method's settings), or a value the configuration rejects.
    """
    config_class = _classes(method)[1]
    fields = {f.name for f in dataclasses.fields(config_class)}
    unknown = sorted(set(settings) - fields)
    if unknown:
        raise ValueError(f"{method} has no setting {', '.join(unknown)}; its settings: {', '.join(sorted(fields))}")
    return config_class(**settings)


def editor_for(method: str, pg: nn.Module, tokenizer: Any, nodes: Sequence[str], config: ROMEConfig | None = None,
               corpus: Corpus | str | os.PathLike[str] | Any | None = None) -> Editor:
    """The editor of ``method`` at ``nodes``.

    Args:
        method: ``"rome"`` (:class:`~editors.ROME`, exactly one node), ``"memit"`` (:class:`~editors.MEMIT`) or
            ``"alphaedit"`` (:class:`~editors.AlphaEdit`).
        pg: the model's :class:`gradpatch.PatchableGraph` (in ``eval()``).
        tokenizer: its tokenizer.
        nodes: NodePaths of the edited linear layers.
        config: the method's configuration (:func:`config_for`; ``None``: its defaults).
        corpus: corpus of the statistics (as :class:`~editors.ROME`).

    Raises:
        ValueError: an unknown method, ROME with other than one node, or a configuration of another method.
        KeyError, LayerKindError: a NodePath is not a linear layer of the graph.
    """
    editor_class, config_class = _classes(method)
    config = config if config is not None else config_class()
    if type(config) is not config_class:
        raise ValueError(f"{method} takes a {config_class.__name__}, got a {type(config).__name__} (config_for("
                         f"{method!r}, ...) builds it)")
    if method == "rome":
        if len(nodes) != 1:
            raise ValueError(f"ROME edits one layer; got {len(nodes)} nodes")
        return ROME(pg, tokenizer, nodes[0], config=config, corpus=corpus)
    return editor_class(pg, tokenizer, nodes, config=config, corpus=corpus)  # type: ignore[call-arg]
