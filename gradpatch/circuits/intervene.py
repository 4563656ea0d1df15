"""Interventions on an attribution graph's features: ablate, scale, clamp or steer chosen transcoder features at
chosen positions and read the new top logits (circuit-tracer's ``ReplacementModel.feature_intervention``).

Each edited (layer, position) gets one splice of its transcoder at that position alone
(:func:`gradpatch.dictionaries.splice` with ``slice=(slice(None), position)``, error term kept), carrying the
:class:`~gradpatch.dictionaries.DictionaryPatch` edits: with a the latents ``[m]`` encoded from the live MLP input
and a' the edited ones, the MLP output becomes

    y + (a' − a) W_dec + Σ_steered α_f W_dec[f]                                   ``[d_model]`` at that position

(y the MLP's own output), as circuit-tracer adds decode(a') − decode(a) to the MLP output hook. Everything else runs
live: later transcoders are not spliced, so the MLPs, norms and (unless frozen) attention respond to the edit.
With ``freeze_attention`` (circuit-tracer's default) the attention patterns are held at their values on the prompt
(:func:`~gradpatch.circuits.freeze.find_frozen_nodes`' attention nodes, replaced by their recorded values).

:func:`intervene_direct` is circuit-tracer's ``direct_effects=True``: the edits run in the local replacement model
(:class:`~gradpatch.circuits.replacement.ReplacementModel`: attention, norms and every spliced MLP output frozen), as
perturbations δ_ℓ at the edited positions, (a'_f − a_f) W_dec[f] per edited feature (α W_dec[f] for a steer; a
cross-layer transcoder's feature adds its decoder block into every layer it writes). The
model is affine there and features do not respond to each other, so the change of a logit is the sum of the graph's
direct edges: ablating feature s changes target t's value by −A[t, s].
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..dictionaries import CrossLayerTranscoder, SparseDictionary, splice, splice_clt
from ..dictionaries.clt_splice import clt_nodes
from ..patchable_graph import PatchableGraph
from ..patches import Patch, ProbePatch, ReplacePatch
from .clt_layers import clt_layer_views
from .complete import decoder_blocks
from .errors import CircuitError, FeatureIndexError
from .freeze import find_frozen_nodes
from .replacement import ReplacementModel

__all__ = ["EDIT_KINDS", "FeatureEdit", "InterventionResult", "intervene", "intervene_direct",
           "top_logits"]

#: What an edit does to a_f: ``ablate`` sets it to 0, ``scale`` multiplies it by ``value``, ``clamp`` sets it to
#: ``value``, ``steer`` adds ``value · W_dec[f]`` to the MLP output (a_f unchanged).
EDIT_KINDS = ("ablate", "scale", "clamp", "steer")


@dataclass(frozen=True)
class FeatureEdit:
    """One edit of feature ``feature`` of the transcoder at ``layer``, at prompt position ``position`` (negative
    counts from the end), as :data:`EDIT_KINDS` describes; ``value`` is unused by ``ablate``."""

    layer: int
    position: int
    feature: int
    kind: str = "ablate"
    value: float = 0.0


@dataclass
class InterventionResult:
    """The logits before and after the edits.

    Attributes:
        logits_before, logits_after: ``[1, seq, vocab]`` (detached).
        top_before, top_after: the ``top_k`` (token id, probability) pairs at the last position.
        activations: each edit's a_f on the edited pass, before the edit (the order of the edits).
    """

    logits_before: torch.Tensor
    logits_after: torch.Tensor
    top_before: list[tuple[int, float]]
    top_after: list[tuple[int, float]]
    activations: list[float]


def top_logits(logits: torch.Tensor, k: int = 10) -> list[tuple[int, float]]:
    """The ``k`` most probable (token id, probability) of ``logits`` ``[vocab]``."""
    probabilities, ids = torch.topk(torch.softmax(logits.float(), dim=-1), min(k, logits.shape[-1]))
    return list(zip(ids.tolist(), probabilities.tolist()))


def _check(edits: Sequence[FeatureEdit], transcoders: Mapping[int, SparseDictionary], seq: int) -> None:
    """Raise :class:`CircuitError` for an edit of an unknown kind or layer, or a position outside the prompt, and
    :class:`FeatureIndexError` for a feature outside its transcoder's latents."""
    for edit in edits:
        if edit.kind not in EDIT_KINDS:
            raise CircuitError(f"{edit}: kind {edit.kind!r} is not one of {EDIT_KINDS}")
        if edit.layer not in transcoders:
            raise CircuitError(f"{edit}: no transcoder at layer {edit.layer}; the transcoders are at layers "
                               f"{sorted(transcoders)}")
        if not -seq <= edit.position < seq:
            raise CircuitError(f"{edit}: position {edit.position} is outside the prompt of {seq} tokens; give "
                               f"0..{seq - 1} (or a negative position from the end)")
        d_sae = transcoders[edit.layer].d_sae
        if not 0 <= edit.feature < d_sae:
            raise FeatureIndexError(f"{edit}: feature {edit.feature} is outside 0..{d_sae - 1}, the latents of the "
                                    f"transcoder at layer {edit.layer} (d_sae={d_sae}); give a feature in that range")


def _splices(pg: PatchableGraph, transcoders: Mapping[int, SparseDictionary], edits: Sequence[FeatureEdit],
             seq: int) -> tuple[dict[str, list[Patch]], list[tuple[Any, int]]]:
    """The patch map of one splice per edited (layer, position), and for each edit (its splice, feature)."""
    groups: dict[tuple[int, int], list[FeatureEdit]] = defaultdict(list)
    for edit in edits:
        groups[(edit.layer, edit.position % seq)].append(edit)
    patch_map: dict[str, list[Patch]] = {}
    spliced: dict[tuple[int, int], Any] = {}
    for (layer, position), group in sorted(groups.items()):
        chosen = {kind: {e.feature: float(e.value) for e in group if e.kind == kind} for kind in EDIT_KINDS}
        spliced[(layer, position)] = splice(pg, transcoders[layer], ablate=sorted(chosen["ablate"]),
                                            scale=chosen["scale"], clamp=chosen["clamp"], steer=chosen["steer"],
                                            slice=(slice(None), position))
        for path, patches in spliced[(layer, position)].patch_map().items():
            patch_map.setdefault(path, []).extend(patches)
    return patch_map, [(spliced[(e.layer, e.position % seq)], e.feature) for e in edits]


def _clt_splices(pg: PatchableGraph, clt: CrossLayerTranscoder, edits: Sequence[FeatureEdit],
                 seq: int) -> tuple[dict[str, list[Patch]], list[tuple[Any, int, int]]]:
    """The patch map of one :func:`~gradpatch.dictionaries.splice_clt` per edited position (edits keyed by (CLT
    layer, latent), the CLT layer of model layer ``edit.layer``), and for each edit (its splice, CLT layer,
    feature)."""
    index = {layer: i for i, layer in enumerate(clt.config.layers or range(clt.n_layers))}
    groups: dict[int, list[FeatureEdit]] = defaultdict(list)
    for edit in edits:
        groups[edit.position % seq].append(edit)
    patch_map: dict[str, list[Patch]] = {}
    spliced: dict[int, Any] = {}
    for position, group in sorted(groups.items()):
        chosen = {kind: {(index[e.layer], e.feature): float(e.value) for e in group if e.kind == kind}
                  for kind in EDIT_KINDS}
        spliced[position] = splice_clt(pg, clt, ablate=sorted(chosen["ablate"]), scale=chosen["scale"],
                                       clamp=chosen["clamp"], steer=chosen["steer"], slice=(slice(None), position))
        for path, patches in spliced[position].patch_map().items():
            patch_map.setdefault(path, []).extend(patches)
    return patch_map, [(spliced[e.position % seq], index[e.layer], e.feature) for e in edits]


def intervene(pg: PatchableGraph, transcoders: Mapping[int, SparseDictionary] | CrossLayerTranscoder,
              ids: torch.Tensor,
              edits: Sequence[FeatureEdit], *, freeze_attention: bool = True, top_k: int = 10,
              forward_kwargs: Mapping[str, Any] | None = None) -> InterventionResult:
    """Run the prompt ``ids`` ``[1, seq]`` as it is and with ``edits`` (module docstring).

    Args:
        pg: the graph (extracted with ``use_cache=False``).
        transcoders: layer -> transcoder whose config names its ``input_node`` and ``output_node``; or a
            cross-layer transcoder (edits name model layers, ``config.layers``; each edited position gets one
            :func:`~gradpatch.dictionaries.splice_clt` at that position alone, so an edit reaches every later
            layer).
        ids: the prompt ``[1, seq]``.
        edits: the feature edits (several may share a layer and position).
        freeze_attention: hold the attention patterns at their values on the prompt (circuit-tracer's default).
        top_k: how many top logits to report.
        forward_kwargs: more keyword arguments of every forward pass.

    Returns:
        An :class:`InterventionResult`; with no edit, ``logits_after`` equals ``logits_before``.

    Raises:
        CircuitError: ``ids`` of more than one row, an edit of an unknown kind, of a layer without a transcoder, or
            at a position outside the prompt.
        FeatureIndexError: a feature index outside the transcoder's latents (a ``CircuitError`` and a
            ``DictionaryConfigError``).
        FrozenNodesNotFoundError: ``freeze_attention`` on a graph without attention nodes.
    """
    if ids.dim() != 2 or ids.shape[0] != 1:
        raise CircuitError(f"intervene on one prompt: give ids [1, seq], got {tuple(ids.shape)}")
    seq = ids.shape[1]
    clt = transcoders if isinstance(transcoders, CrossLayerTranscoder) else None
    _check(edits, clt_layer_views(clt, *clt_nodes(clt, pg=pg)) if clt is not None else transcoders, seq)
    kwargs = dict(forward_kwargs or {})
    probes = {path: ProbePatch() for path in (find_frozen_nodes(pg).attention if freeze_attention else ())}
    with torch.no_grad(), pg.patch({path: [probe] for path, probe in probes.items()}):
        before = pg(ids, **kwargs).logits.detach()
    if clt is not None:
        patch_map, clt_features = _clt_splices(pg, clt, edits, seq)
    else:
        patch_map, features = _splices(pg, transcoders, edits, seq)
    for path, probe in probes.items():
        patch_map.setdefault(path, []).insert(0, ReplacePatch(value=probe.activation))
    with torch.no_grad(), pg.patch(patch_map):
        after = pg(ids, **kwargs).logits.detach()
    if clt is not None:
        activations = [float(spliced.latents[layer][0, feature]) for spliced, layer, feature in clt_features]
    else:
        activations = [float(spliced.latents[0, feature]) for spliced, feature in features]
    return InterventionResult(before, after, top_logits(before[0, -1], top_k), top_logits(after[0, -1], top_k),
                              activations)


def _edited_activation(edit: FeatureEdit, activation: float) -> float:
    """a'_f of ``edit`` for a_f = ``activation`` (a steer leaves it, adding α W_dec[f] instead)."""
    return {"ablate": 0.0, "scale": activation * edit.value, "clamp": edit.value}.get(edit.kind, activation)


def intervene_direct(model: ReplacementModel, edits: Sequence[FeatureEdit], *, top_k: int = 10) -> InterventionResult:
    """Run ``model``'s prompt in the frozen replacement model as it is and with ``edits`` (module docstring).

    Args:
        model: the local replacement model of the prompt.
        edits: the feature edits, applied one after another (a later edit of the same feature sees the earlier one).
        top_k: how many top logits to report.

    Returns:
        An :class:`InterventionResult` (logits of the replacement model; with no edit, the model's own).

    Raises:
        CircuitError: an edit of an unknown kind, of a layer without a transcoder, or at a position outside the
            prompt.
        FeatureIndexError: a feature index outside the transcoder's latents (a ``CircuitError`` and a
            ``DictionaryConfigError``).
    """
    seq = model.ids.shape[1]
    _check(edits, {layer: spliced.transcoder for layer, spliced in model.layers.items()}, seq)
    deltas: dict[int, torch.Tensor] = {}
    current: dict[tuple[int, int, int], float] = {}
    activations = []
    for edit in edits:
        spliced, position = model.layers[edit.layer], edit.position % seq
        key = (edit.layer, position, edit.feature)
        activation = current.get(key, float(spliced.activations[0, position, edit.feature]))
        activations.append(activation)
        change = edit.value if edit.kind == "steer" else _edited_activation(edit, activation) - activation
        current[key] = _edited_activation(edit, activation)
        for written, decoder in decoder_blocks(model, edit.layer):  # a CLT feature writes every later layer
            delta = deltas.setdefault(written, torch.zeros_like(model.layers[written].constant))
            delta[0, position] += change * decoder[edit.feature].to(delta.dtype)
    with torch.no_grad():
        before = model.run().logits.detach()
        after = model.run(1, deltas).logits.detach()
    return InterventionResult(before, after, top_logits(before[0, -1], top_k), top_logits(after[0, -1], top_k),
                              activations)
