"""A float64 copy of a replacement model, for computations whose results are differences of backward passes (head
loadings, :mod:`gradpatch.circuits.heads`).

The local replacement model (:mod:`gradpatch.circuits.replacement`) is affine in its sources once the prompt is
recorded: its linear map is fixed by the model's weights and the recorded values (frozen patterns, norm scales,
error terms, activations). Converting those from float32 (or bfloat16) to float64 is exact, so the copy computes the
same linear map with float64 rounding: a quantity that is a difference of large rows (a head's loading is the
difference of two rows of one backward pass) keeps ~1e-16 of the rows' size instead of ~1e-7. Nothing of the given
model is changed: the wrapped model and the transcoders are copied (the graph is extracted again around the copy,
from the same example inputs: :meth:`PatchableGraph.save` and :meth:`PatchableGraph.load`).

A model may cast to a fixed dtype inside its graph (Llama's RMSNorm computes x · rsqrt in float32 whatever its
input's dtype): :func:`float64_casts` of :func:`cast_nodes` gives patches under which such a cast passes its float64
input on unchanged (a cast is the identity up to rounding, so the affine map is the same), so that no step of a pass
rounds to float32 (on the tiny Llama, the casts alone left head loadings 2.9e-5 relative off their edges).
"""

from __future__ import annotations

import copy
import dataclasses
import io
from typing import Any

import torch

from ..patchable_graph import PatchableGraph
from ..patches import CustomPatch, HoldPatch, Patch
from .clt_layers import CLTLayerView
from .errors import CircuitError, FrozenNodesNotFoundError
from .freeze import argument_path
from .replacement import ReplacementModel

__all__ = ["cast_nodes", "float64_casts", "float64_replacement"]

#: The ops that cast a tensor (``x.to(torch.float32)``, ``x.float()``, ...).
_CASTS = frozenset(f"call_method:{name}" for name in ("to", "float", "type", "half", "bfloat16"))


def _double(value: Any) -> Any:
    """``value`` with every floating tensor in it (through tuples, lists and dicts) converted to float64."""
    if isinstance(value, torch.Tensor):
        return value.double() if value.is_floating_point() else value
    if isinstance(value, (list, tuple)):
        return type(value)(_double(v) for v in value)
    if isinstance(value, dict):
        return {key: _double(v) for key, v in value.items()}
    return value


def float64_replacement(model: ReplacementModel) -> ReplacementModel:
    """A copy of ``model`` whose model, transcoders and recorded values are float64 (module docstring); ``model``
    itself when it is float64 already.

    Args:
        model: a replacement model.

    Returns:
        A :class:`ReplacementModel` computing the same affine map in float64 (its prompt is not recorded again).

    Raises:
        CircuitError: the graph cannot be extracted again around the copy (the message names the alternative).
    """
    if model.embeddings.dtype == torch.float64:
        return model
    wrapped = copy.deepcopy(model.pg.wrapped_model).double()
    saved = io.BytesIO()
    model.pg.save(saved, weights=False)
    saved.seek(0)
    try:
        pg = PatchableGraph.load(saved, wrapped, check_fingerprint=False)
    except ValueError as error:  # e.g. a graph extracted with custom functions, which a saved graph cannot name
        raise CircuitError(f"no float64 copy of the model's graph could be extracted ({error}); compute in the "
                           f"model's own dtype instead (head_loadings(..., float64=False))") from error
    twin = copy.copy(model)
    twin.pg = pg
    for name, value in vars(model).items():
        if name not in ("pg", "clt", "layers", "frozen"):
            setattr(twin, name, _double(value))
    clt = copy.deepcopy(model.clt).double() if model.clt is not None else None
    twin.clt = clt
    layers = {}
    for layer, spliced in model.layers.items():
        transcoder = spliced.transcoder
        if isinstance(transcoder, CLTLayerView) and clt is not None:
            twin_transcoder: Any = CLTLayerView(clt, transcoder.index, transcoder.config.input_node,
                                                transcoder.config.output_node)
        else:
            twin_transcoder = copy.deepcopy(transcoder).double()
        fields = {field.name: _double(getattr(spliced, field.name)) for field in dataclasses.fields(spliced)
                  if field.name != "transcoder"}
        layers[layer] = dataclasses.replace(spliced, transcoder=twin_transcoder, **fields)
    twin.layers = layers
    return twin


def cast_nodes(model: ReplacementModel) -> list[tuple[str, str]]:
    """(NodePath of a cast op, NodePath of the tensor it casts) for every cast of ``model``'s graph whose input is an
    op's value (a cast of a parameter or a constant needs nothing: the copy's parameters are float64), for
    :func:`float64_casts`."""
    pg = model.pg
    found = []
    for path in pg.node_paths():
        if "|" in path or pg.node(path).op_name not in _CASTS:
            continue
        call = pg.node(path).fx_node
        source = call.args[0] if call.args else None
        if getattr(source, "op", "get_attr") == "get_attr":
            continue
        try:
            found.append((path, argument_path(pg, path, source)))
        except FrozenNodesNotFoundError:  # an input from outside this graph's nodes: left as the model casts it
            continue
    return found


def _keep_float64(reader: HoldPatch) -> Any:
    """A cast's replacement: its float64 input (read by ``reader``) where it would round it to a lower precision."""
    def keep(original: Any) -> Any:
        value = reader.held
        if (isinstance(original, torch.Tensor) and isinstance(value, torch.Tensor) and original.is_floating_point()
                and value.dtype == torch.float64 and original.dtype != torch.float64
                and value.shape == original.shape):
            return value
        return original
    return keep


def float64_casts(casts: list[tuple[str, str]]) -> dict[str, list[Patch]]:
    """Patches for :meth:`ReplacementModel.run` of a float64 model under which each of its ``casts``
    (:func:`cast_nodes`) passes its input on where it would round it to a lower precision (module docstring); fresh
    patches per pass (they hold the pass's values)."""
    patches: dict[str, list[Patch]] = {}
    for cast, source in casts:
        reader = HoldPatch()
        patches.setdefault(source, []).append(reader)
        patches.setdefault(cast, []).append(CustomPatch(custom_op=_keep_float64(reader), requires_clone=False))
    return patches
