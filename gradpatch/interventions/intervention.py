"""Interventions: learnable patches as an ``nn.Module``, saved as safetensors + JSON (never pickle)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
from safetensors.torch import save as save_safetensors
from torch import nn

from ..errors import FingerprintMismatchError, InterventionLoadError
from ..files.atomic import atomic_write_bytes, atomic_write_text, read_json, read_tensors, sha256_hex
from ..finite import check_finite
from ..files.fingerprint import model_fingerprint
from ..patches import AddPatch, CustomPatch, Patch, ProbePatch, RecordPatch, ReplacePatch, ZeroPatch
from .subspace import TRAINABLE_KINDS, TrainablePatch

FORMAT = "gradpatch.interventions.intervention"
#: 2: value shapes and dtypes, Python scalar values, the tensors file's SHA-256 (version 1 files still load).
#: 3: trainable subspace patches (kind, constructor config, one tensor per state_dict entry with its shape).
#: 4: an orthogonal weight saved as the matrix itself (``rotation.weight``, R ``[k, d]``) instead of torch's
#: parametrization internals (:meth:`~gradpatch.interventions.TrainablePatch.saved_state`; version 3 files still load).
VERSION = 4
JSON_NAME = "intervention.json"
TENSORS_NAME = "intervention.safetensors"
_KINDS: dict[str, type[Patch]] = {
    cls.__name__: cls for cls in (ZeroPatch, AddPatch, ReplacePatch, ProbePatch, RecordPatch)
}
#: Kinds that carry a value (a tensor saved in the safetensors file, or a Python number kept in the JSON).
_VALUED = ("AddPatch", "ReplacePatch")


class Intervention(nn.Module):
    """Patches at NodePaths whose tensor values are ``nn.Parameter``s: optimisers, Lightning and ``state_dict``
    see exactly the learnable intervention and nothing of the frozen model.

    ``with pg.patch(intervention): ...`` applies it. Tensor values of ``AddPatch``/``ReplacePatch`` become
    parameters (an ``nn.Parameter`` given is used as is; another tensor is copied into a new one); trainable
    subspace patches (:mod:`gradpatch.interventions.subspace`) are registered as submodules (``self.trainable``).

    Args:
        patches: NodePath -> patch or list of patches, e.g.
            ``{"model.layers_5.output": AddPatch(value=torch.zeros(576))}`` (a steering vector ``[d_model]``).
    """

    def __init__(self, patches: Mapping[str, Patch | Sequence[Patch]]) -> None:
        super().__init__()
        self.values = nn.ParameterList()
        self.trainable = nn.ModuleList()
        self._entries: list[tuple[str, Patch, int | None]] = []
        for path, spec in patches.items():
            for patch in [spec] if isinstance(spec, Patch) else list(spec):
                index = None
                if isinstance(patch, TrainablePatch):
                    self._entries.append((str(path), patch, len(self.trainable)))
                    self.trainable.append(patch)
                    continue
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
        """Write ``intervention.safetensors`` (the values) and then ``intervention.json`` (NodePaths, patch kinds,
        slices, value shapes, model fingerprint, the SHA-256 of the tensors file) into ``directory``.

        Each file is written atomically (temporary file + rename), the JSON last: a crash leaves the previous
        intervention, or a pair whose digest check fails on load, never a silently mismatched pair.

        Args:
            directory: created if missing.
            model: the model the intervention belongs to; its fingerprint is recorded and checked on load.

        Returns:
            ``directory``.

        Raises:
            ValueError: a ``CustomPatch`` (a Python function cannot be saved without pickle) or a slice holding
                something other than ints, slices, ``Ellipsis``, ``None`` and lists of ints.
            NonFiniteError: a value holds NaN or inf (nothing is written).
        """
        directory = Path(directory)
        records = []
        values: dict[str, torch.Tensor] = {}
        for n, (path, patch, index) in enumerate(self._entries):
            kind = type(patch).__name__
            if isinstance(patch, CustomPatch) or kind not in {**_KINDS, **TRAINABLE_KINDS}:
                raise ValueError(f"{kind} at '{path}' cannot be saved without pickle; save its "
                                 f"tensors with safetensors yourself or express it as AddPatch/ReplacePatch")
            record: dict[str, Any] = {"path": path, "kind": kind, "slice": encode_slice(patch.slice), "value": None}
            scalar = getattr(patch, "value", None)
            if isinstance(patch, TrainablePatch):
                state = patch.saved_state()
                record.update(config=patch.config(), tensors={
                    name: {"key": f"trainable.{index}.{name}", "shape": list(t.shape), "dtype": str(t.dtype)}
                    for name, t in state.items()})
                values.update({f"{path} ({kind} {n}) {name}": t for name, t in state.items()})
            elif index is not None:
                value = self.values[index]
                record.update(value=f"values.{index}", shape=list(value.shape), dtype=str(value.dtype))
                values[f"{path} ({kind} {n})"] = value
            elif isinstance(scalar, (bool, int, float)):
                record["scalar"] = scalar
                values[f"{path} ({kind} {n})"] = torch.tensor(float(scalar))
            elif kind in _VALUED:
                raise ValueError(f"{kind} at '{path}' has value {scalar!r}; only tensors and Python numbers are saved")
            records.append(record)
        check_finite(values, "intervention values at", "nothing was saved: stop the optimisation before it "
                     "diverges (lower the learning rate) and save finite values")
        tensors = {f"values.{i}": value.detach().contiguous().cpu() for i, value in enumerate(self.values)}
        for i, module in enumerate(self.trainable):
            tensors.update({f"trainable.{i}.{name}": t.detach().contiguous().cpu().clone()
                            for name, t in module.saved_state().items()})
        data = save_safetensors(tensors)
        document = {"format": FORMAT, "version": VERSION, "patches": records,
                    "model_fingerprint": None if model is None else model_fingerprint(model),
                    "tensors_sha256": sha256_hex(data)}
        atomic_write_bytes(directory / TENSORS_NAME, data)
        atomic_write_text(directory / JSON_NAME, json.dumps(document, indent=2))
        return directory

    @classmethod
    def load(cls, directory: str | Path, graph: Any = None, model: nn.Module | None = None,
             check_fingerprint: bool = True, like: "Intervention | None" = None) -> "Intervention":
        """Read an intervention written by :meth:`save`, checking both files before building anything.

        Args:
            directory: the folder holding ``intervention.json`` and ``intervention.safetensors``.
            graph: a :class:`~gradpatch.PatchableGraph`; every saved NodePath is checked against it, and without
                ``model`` its wrapped model's fingerprint is compared with the saved one.
            model: the model the intervention is for; its fingerprint must equal the saved one.
            check_fingerprint: ``False`` loads an intervention saved for another model (no fingerprint check).
                Interventions saved without a model have no fingerprint to check.
            like: an intervention the saved one must match: the same NodePaths, patch kinds and trainable patch
                configurations (width, subspace size), in order (e.g. the one a training recipe builds).

        Raises:
            InterventionLoadError: a file is missing, unreadable or garbled; not a gradpatch intervention or of a
                newer version; a record is incomplete or of a kind that cannot be loaded; a NodePath has an empty
                component; a value's shape differs from the recorded one; the two files come from different saves;
                a trainable patch's config or tensors do not fit its kind; the saved patches differ from ``like``'s.
            FingerprintMismatchError: the saved fingerprint differs from the model's (both are named).
            KeyError: saved NodePaths that do not exist in ``graph`` (each with the closest valid ones).
        """
        directory = Path(directory)
        json_path, tensors_path = directory / JSON_NAME, directory / TENSORS_NAME
        fix = "save the intervention again with Intervention.save"
        document = read_json(json_path, InterventionLoadError, fix)
        if document.get("format") != FORMAT or not isinstance(document.get("version"), int) \
                or document["version"] > VERSION:
            raise InterventionLoadError(f"{json_path} is not a gradpatch intervention of version <= {VERSION}; "
                                        f"{fix} (or upgrade gradpatch)")
        records = _records(document, json_path, fix)
        tensors = read_tensors(tensors_path, InterventionLoadError, fix, document.get("tensors_sha256"))
        if like is not None:
            _check_like(like, records, json_path)
        if graph is not None:
            _check_paths(graph, [record["path"] for record in records])
        reference = model if model is not None else getattr(graph, "wrapped_model", None)
        saved = document.get("model_fingerprint")
        if check_fingerprint and saved is not None and reference is not None:
            current = model_fingerprint(reference)
            if current != saved:
                raise FingerprintMismatchError(
                    f"{json_path} was saved for a model with fingerprint {saved}, but this model's is {current}: "
                    f"load it with the model it was trained on, or pass check_fingerprint=False to load it anyway")
        patches: dict[str, list[Patch]] = {}
        for record in records:
            kwargs: dict[str, Any] = {"slice": record["slice"]}
            if record["kind"] in TRAINABLE_KINDS:
                patches.setdefault(record["path"], []).append(_trainable(tensors, record, tensors_path, fix))
                continue
            if record["value"] is not None:
                kwargs["value"] = nn.Parameter(_value(tensors, record, tensors_path, fix))
            elif "scalar" in record:
                kwargs["value"] = record["scalar"]
            patches.setdefault(record["path"], []).append(_KINDS[record["kind"]](**kwargs))
        return cls(patches)


def _records(document: dict[str, Any], json_path: Path, fix: str) -> list[dict[str, Any]]:
    """The patch records of an intervention document, checked and with their slices decoded.

    Raises:
        InterventionLoadError: naming the file and the first bad record.
    """
    raw = document.get("patches")
    if not isinstance(raw, list):
        raise InterventionLoadError(f"{json_path} has no 'patches' list; {fix}")
    records = []
    for i, record in enumerate(raw):
        where = f"{json_path}, patch {i}"
        if not isinstance(record, dict) or not {"path", "kind", "slice", "value"} <= set(record):
            raise InterventionLoadError(f"{where}: a record needs 'path', 'kind', 'slice' and 'value'; {fix}")
        path, kind = record["path"], record["kind"]
        if not isinstance(path, str) or "" in re.split(r"[.|]", path):
            raise InterventionLoadError(f"{where}: NodePath {path!r} is not a dot-joined path of non-empty names "
                                        f"(e.g. 'model.layers_0.mlp.down_proj.output'); {fix}")
        if kind in TRAINABLE_KINDS:
            if not isinstance(record.get("config"), dict) or not isinstance(record.get("tensors"), dict):
                raise InterventionLoadError(f"{where}: a {kind} record needs 'config' and 'tensors' mappings; {fix}")
        elif kind not in _KINDS:
            raise InterventionLoadError(
                f"{where}: patch kind {kind!r} cannot be loaded; saved interventions hold only "
                f"{', '.join(sorted([*_KINDS, *TRAINABLE_KINDS]))} (a CustomPatch's Python function is never saved: "
                f"rebuild it in code)")
        scalar = record.get("scalar")
        has_value = isinstance(record["value"], str) or (isinstance(scalar, (int, float)) and math.isfinite(scalar))
        if kind not in TRAINABLE_KINDS and (kind in _VALUED) != has_value:
            raise InterventionLoadError(f"{where}: a {kind} {'needs a' if kind in _VALUED else 'takes no'} "
                                        f"(finite) value; {fix}")
        try:
            index = decode_slice(record["slice"])
        except (KeyError, TypeError, ValueError) as exc:
            raise InterventionLoadError(f"{where}: slice {record['slice']!r} cannot be decoded ({exc}); {fix}") from exc
        records.append({**record, "slice": index})
    return records


def _value(tensors: dict[str, torch.Tensor], record: dict[str, Any], tensors_path: Path, fix: str) -> torch.Tensor:
    """The tensor a record names, checked against the shape and dtype the record holds (version 2 files).

    Raises:
        InterventionLoadError: the tensor is missing, or has another shape (rank included) or dtype.
    """
    name = record["value"]
    if name not in tensors:
        raise InterventionLoadError(f"{tensors_path} lacks tensor {name!r} for '{record['path']}'; {fix}")
    value = tensors[name]
    expected = (record.get("shape"), record.get("dtype"))
    found = (list(value.shape), str(value.dtype))
    if expected[0] is not None and (found[0] != expected[0] or found[1] != expected[1]):
        raise InterventionLoadError(f"{tensors_path}: {name!r} for '{record['path']}' is {found[1]} of shape "
                                    f"{found[0]}, but intervention.json records {expected[1]} of shape "
                                    f"{expected[0]}; {fix}")
    return value


def _trainable(tensors: dict[str, torch.Tensor], record: dict[str, Any], tensors_path: Path,
               fix: str) -> TrainablePatch:
    """Rebuild a trainable subspace patch from its record: the constructor from ``config``, then its saved state
    (:meth:`~gradpatch.interventions.TrainablePatch.saved_state`: an orthogonal R itself; files written before hold the
    full ``state_dict`` with torch's parametrization internals, and load too).

    Raises:
        InterventionLoadError: the config does not build the kind, or a tensor is missing or of another shape.
    """
    kind, where = record["kind"], f"{tensors_path}: {record['kind']} at '{record['path']}'"
    try:
        patch = TRAINABLE_KINDS[kind](**record["config"], slice=record["slice"])
    except (TypeError, ValueError) as error:
        raise InterventionLoadError(f"{where}: config {record['config']!r} does not build a {kind} ({error}); "
                                    f"{fix}") from error
    expected = patch.saved_state()
    if set(record["tensors"]) == set(patch.state_dict()):
        expected = patch.state_dict()
    if set(record["tensors"]) != set(expected):
        raise InterventionLoadError(f"{where}: saved tensors {sorted(record['tensors'])}, but a {kind} of config "
                                    f"{record['config']} has {sorted(expected)}; {fix}")
    state = {}
    for name, entry in record["tensors"].items():
        value = tensors.get(entry.get("key")) if isinstance(entry, dict) else None
        if value is None:
            raise InterventionLoadError(f"{where}: tensor {name!r} is missing from the tensors file; {fix}")
        if value.shape != expected[name].shape or list(value.shape) != entry.get("shape"):
            raise InterventionLoadError(f"{where}: tensor {name!r} has shape {list(value.shape)}, but a {kind} of "
                                        f"config {record['config']} needs {list(expected[name].shape)}; {fix}")
        state[name] = value
    patch.load_saved_state(state)
    return patch


def _check_like(like: Intervention, records: list[dict[str, Any]], json_path: Path) -> None:
    """Raise :class:`InterventionLoadError` unless the saved patches are ``like``'s (path, kind, config)."""
    def signature(path: str, kind: str, config: Any) -> str:
        return f"{kind}{config or ''} at '{path}'"

    saved = [signature(r["path"], r["kind"], r.get("config")) for r in records]
    wanted = [signature(path, type(p).__name__, p.config() if isinstance(p, TrainablePatch) else None)
              for path, p, _ in like._entries]
    if saved != wanted:
        raise InterventionLoadError(f"{json_path} holds {saved}, but this configuration expects {wanted}: load "
                                    f"the intervention with the configuration it was trained with, or train again")


def _check_paths(graph: Any, paths: list[str]) -> None:
    problems = []
    for path in paths:
        try:
            graph.node(path)
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
