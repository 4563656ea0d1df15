"""Interventions: learnable patches as an ``nn.Module``, saved as safetensors + JSON (never pickle)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from .fingerprint import model_fingerprint
from .patches import AddPatch, CustomPatch, Patch, ProbePatch, RecordPatch, ReplacePatch, ZeroPatch

FORMAT = "gradpatch.intervention"
VERSION = 1
JSON_NAME = "intervention.json"
TENSORS_NAME = "intervention.safetensors"
_KINDS: dict[str, type[Patch]] = {
    cls.__name__: cls for cls in (ZeroPatch, AddPatch, ReplacePatch, ProbePatch, RecordPatch)
}


class Intervention(nn.Module):
    """Patches at NodePaths whose tensor values are ``nn.Parameter``s: optimisers, Lightning and ``state_dict``
    see exactly the learnable intervention and nothing of the frozen model.

    ``with pg.patch(intervention): ...`` applies it. Tensor values of ``AddPatch``/``ReplacePatch`` become
    parameters (an ``nn.Parameter`` given is used as is; another tensor is copied into a new one).

    Args:
        patches: NodePath -> patch or list of patches, e.g.
            ``{"model.layers_5.output": AddPatch(value=torch.zeros(576))}`` (a steering vector ``[d_model]``).
    """

    def __init__(self, patches: Mapping[str, Patch | Sequence[Patch]]) -> None:
        super().__init__()
        self.values = nn.ParameterList()
        self._entries: list[tuple[str, Patch, int | None]] = []
        for path, spec in patches.items():
            for patch in [spec] if isinstance(spec, Patch) else list(spec):
                index = None
                value = getattr(patch, "value", None)
                if isinstance(value, torch.Tensor):
                    parameter = value if isinstance(value, nn.Parameter) else nn.Parameter(value.detach().clone())
                    patch.value = parameter  # type: ignore[attr-defined]
                    index = len(self.values)
                    self.values.append(parameter)
                self._entries.append((str(path), patch, index))

    def patch_map(self) -> dict[str, list[Patch]]:
        """NodePath -> patches, as ``PatchableGraph.patch`` takes them."""
        mapping: dict[str, list[Patch]] = {}
        for path, patch, _ in self._entries:
            mapping.setdefault(path, []).append(patch)
        return mapping

    def save(self, directory: str | Path, model: nn.Module | None = None) -> Path:
        """Write ``intervention.json`` (NodePaths, patch kinds, slices, model fingerprint) and
        ``intervention.safetensors`` (the values) into ``directory``.

        Args:
            directory: created if missing.
            model: the model the intervention belongs to; its fingerprint is recorded and checked on load.

        Raises:
            ValueError: a ``CustomPatch`` (a Python function cannot be saved without pickle) or a slice holding
                something other than ints, slices, ``Ellipsis``, ``None`` and lists of ints.
        """
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        records = []
        for path, patch, index in self._entries:
            if isinstance(patch, CustomPatch) or type(patch).__name__ not in _KINDS:
                raise ValueError(f"{type(patch).__name__} at '{path}' cannot be saved without pickle; save its "
                                 f"tensors with safetensors yourself or express it as AddPatch/ReplacePatch")
            records.append({"path": path, "kind": type(patch).__name__, "slice": encode_slice(patch.slice),
                            "value": None if index is None else f"values.{index}"})
        document = {"format": FORMAT, "version": VERSION, "patches": records,
                    "model_fingerprint": None if model is None else model_fingerprint(model)}
        tensors = {f"values.{i}": value.detach().contiguous().cpu() for i, value in enumerate(self.values)}
        save_file(tensors, str(directory / TENSORS_NAME))
        (directory / JSON_NAME).write_text(json.dumps(document, indent=2))
        return directory

    @classmethod
    def load(cls, directory: str | Path, graph: Any = None, model: nn.Module | None = None) -> "Intervention":
        """Read an intervention written by :meth:`save`.

        Args:
            directory: the folder holding ``intervention.json`` and ``intervention.safetensors``.
            graph: a :class:`~gradpatch.PatchableGraph`; every saved NodePath is checked against it.
            model: compare the saved model fingerprint with this model's (a mismatch warns).

        Raises:
            FileNotFoundError: the files are missing.
            ValueError: not a gradpatch intervention, or of a newer format version.
            KeyError: saved NodePaths that do not exist in ``graph`` (each with the closest valid ones).
        """
        directory = Path(directory)
        document = json.loads((directory / JSON_NAME).read_text())
        if document.get("format") != FORMAT or document.get("version", 0) > VERSION:
            raise ValueError(f"{directory / JSON_NAME} is not a gradpatch intervention of version <= {VERSION}")
        tensors = load_file(str(directory / TENSORS_NAME))
        if graph is not None:
            _check_paths(graph, [record["path"] for record in document["patches"]])
        if model is not None and document.get("model_fingerprint") not in (None, model_fingerprint(model)):
            warnings.warn(f"intervention in {directory} was saved for a model with another fingerprint",
                          stacklevel=2)
        patches: dict[str, list[Patch]] = {}
        for record in document["patches"]:
            kwargs: dict[str, Any] = {"slice": decode_slice(record["slice"])}
            if record["value"] is not None:
                kwargs["value"] = nn.Parameter(tensors[record["value"]])
            patches.setdefault(record["path"], []).append(_KINDS[record["kind"]](**kwargs))
        return cls(patches)


def _check_paths(graph: Any, paths: list[str]) -> None:
    problems = []
    for path in paths:
        try:
            graph._tree.find(path)
        except KeyError as error:
            problems.append(str(error.args[0]))
    if problems:
        raise KeyError("the intervention's NodePaths do not exist in this graph:\n" + "\n".join(problems))


def encode_slice(index: Any) -> Any:
    """A patch ``slice`` as JSON: ints, ``None``, lists of ints, and tagged slices/ellipses/tuples.

    Raises:
        ValueError: for anything else (tensors, say).
    """
    if index is None or isinstance(index, (bool, int)):
        return index
    if index is Ellipsis:
        return {"ellipsis": True}
    if isinstance(index, slice):
        return {"slice": [encode_slice(index.start), encode_slice(index.stop), encode_slice(index.step)]}
    if isinstance(index, tuple):
        return {"tuple": [encode_slice(item) for item in index]}
    if isinstance(index, list) and all(isinstance(item, int) for item in index):
        return {"list": index}
    raise ValueError(f"slice {index!r} cannot be saved as JSON; use ints, slices, Ellipsis, None or lists of ints")


def decode_slice(encoded: Any) -> Any:
    """Inverse of :func:`encode_slice`."""
    if not isinstance(encoded, dict):
        return encoded
    if "ellipsis" in encoded:
        return Ellipsis
    if "slice" in encoded:
        return slice(*(decode_slice(item) for item in encoded["slice"]))
    if "tuple" in encoded:
        return tuple(decode_slice(item) for item in encoded["tuple"])
    return list(encoded["list"])
