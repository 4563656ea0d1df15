"""The local replacement model of one prompt (Ameisen et al. 2025, "Circuit Tracing", section 2.2).

Transcoders are spliced at chosen MLPs with their error terms (:func:`gradpatch.dictionaries.splice`), so that on
the prompt the forward pass is the model's. At each spliced layer ℓ the MLP output ``[1, seq, d_model]`` splits as::

    y_ℓ = Σ_f a_ℓf W_dec[f] + b_dec + x_ℓ W_skipᵀ + e_ℓ,      e_ℓ = y_ℓ − output(x_ℓ, a_ℓ)   (the error term)

with x_ℓ the transcoder's input and a_ℓ = σ(x_ℓ W_enc + b_enc) its latents. The replacement model replays the prompt
with every attention pattern and normalisation scale frozen, and every elementwise nonlinearity after them (such as
Gemma 2's final logit soft-capping) linearised at the prompt (:mod:`gradpatch.circuits.freeze`), and every MLP output
replaced by c_ℓ + x_ℓ W_skipᵀ + δ_ℓ, where c_ℓ = Σ_f a_ℓf W_dec[f] + b_dec + e_ℓ is recorded (features and errors are
injected, so no gradient passes through a transcoder's encoder) and δ_ℓ ``[batch, seq, d_model]`` is an added
perturbation (zero, or a parameter whose gradient is ∂target/∂y_ℓ). The token embeddings take an added δ_E likewise.
Everything from embeddings and MLP outputs to the transcoders' pre-activations h_ℓ = x_ℓ W_enc + b_enc and to the
logits is then affine, which is what makes the attribution graph's edges exact.

What a pass computes for nothing is left out where the graph allows it, values and gradients unchanged:

- a replaced MLP whose transcoder reads its graph's own input (``<mlp>.x``) and writes its output (``<mlp>.output``)
  runs on no position once the transcoder has read the live input (its output is replaced, so only the transcoder
  sees x_ℓ; patches inside the MLP's graph see ``[batch, 0, d_in]``): on SmolLM2 the MLPs were two thirds of a
  64-row forward pass, and their weights most of what a one-row pass reads;
- an SDPA call whose pattern is frozen (:class:`~gradpatch.circuits.freeze.FrozenPattern`) returns its own value
  (bit for bit) plus A⁰ (v − v), so that gradients reach v through A⁰ᵀ alone, not through SDPA's backward.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch

from ..dictionaries import SparseDictionary, TranscoderInput, splice
from ..dictionaries.clt import CrossLayerTranscoder
from ..dictionaries.clt_splice import clt_nodes, splice_clt
from ..dictionaries.splice import dictionary_nodes
from ..errors import FingerprintMismatchError
from ..files.fingerprint import model_fingerprint
from ..layouts import detect_layout
from ..patchable_graph import PatchableGraph
from ..patches import AddPatch, CustomPatch, HoldPatch, Patch, ProbePatch, ReplacePatch
from .clt_layers import CLTLayerView, clt_layer_views
from .errors import CircuitError
from .freeze import FrozenLayerNorm, FrozenNodes, FrozenPattern, LinearisedOp, find_frozen_nodes
from .paths import check_paths
from .replacement_ops import (frozen_op, layer_norm_op, linearised_op, output_op, pattern_op,
                              recorded_op)

__all__ = ["ReplacementModel", "ReplacementRun", "SplicedLayer"]


@dataclass
class SplicedLayer:
    """One transcoder and what it read and wrote on the prompt.

    Attributes:
        transcoder: the (skip) transcoder, or one layer of a cross-layer transcoder (:class:`CLTLayerView`; then
            a_ℓ W_dec stands for Σ_{s ≤ ℓ} a_s W_dec[s → ℓ], the decoders of every CLT layer up to ℓ).
        input_node, output_node: the NodePaths it reads (the MLP input) and writes (the MLP output).
        inputs: x_ℓ ``[1, seq, d_in]``.
        activations: a_ℓ ``[1, seq, m]``.
        errors: e_ℓ ``[1, seq, d_out]``.
        outputs: y_ℓ, the MLP's output ``[1, seq, d_out]``.
        constant: c_ℓ = a_ℓ W_dec + b_dec + e_ℓ = y_ℓ − x_ℓ W_skipᵀ ``[1, seq, d_out]``.
    """

    transcoder: SparseDictionary | CLTLayerView
    input_node: str
    output_node: str
    inputs: torch.Tensor
    activations: torch.Tensor
    errors: torch.Tensor
    outputs: torch.Tensor
    constant: torch.Tensor


@dataclass
class ReplacementRun:
    """One forward pass of the replacement model.

    Attributes:
        logits: ``[batch, seq, vocab]`` (``[batch, 1, vocab]`` where a patch kept the last position alone).
        inputs: layer -> x_ℓ ``[batch, seq, d_in]`` (with autograd history).
        transcoders: layer -> its transcoder.
    """

    logits: torch.Tensor
    inputs: dict[int, torch.Tensor]
    transcoders: dict[int, SparseDictionary | CLTLayerView]

    @cached_property
    def pre_activations(self) -> dict[int, torch.Tensor]:
        """layer -> h_ℓ = x_ℓ W_enc + b_enc ``[batch, seq, m]`` (computed when first read, with autograd history)."""
        return {layer: self.transcoders[layer].pre_activations(x) for layer, x in self.inputs.items()}


class ReplacementModel:
    """The frozen, spliced model of one prompt ``ids`` ``[1, seq]`` (module docstring).

    Args:
        pg: the graph (extracted with ``use_cache=False``).
        transcoders: layer index -> transcoder whose config names its ``input_node`` and ``output_node``; or a
            :class:`~gradpatch.dictionaries.CrossLayerTranscoder` whose config names its ``input_nodes`` and
            ``output_nodes`` (model layer ``config.layers[l]`` per CLT layer l), spliced with
            :func:`~gradpatch.dictionaries.splice_clt` (one error term per layer).
        ids: the prompt's token ids ``[1, seq]``.
        embed: the NodePath of the token embeddings ``[1, seq, d_model]`` (default: the model layout's).
        forward_kwargs: more keyword arguments of every forward pass.

    Raises:
        CircuitError: no transcoders, an SAE, ``ids`` of more than one row, or a prompt longer than the model's
            context (``config.max_position_embeddings`` or ``n_positions``).
        DictionaryConfigError: a transcoder whose config names no input or output node
            (:func:`~gradpatch.dictionaries.splice.dictionary_nodes`).
        NodePathError: a transcoder's node that the graph lacks.
        FingerprintMismatchError: a transcoder whose config records another model's fingerprint.
        FrozenNodesNotFoundError: the graph lacks attention or normalisation nodes to freeze.
        NoPathError: a transcoder's input node that does not depend on the embeddings, or an output node that the
            logits do not depend on (:func:`~gradpatch.circuits.paths.check_paths`).
    """

    def __init__(self, pg: PatchableGraph, transcoders: Mapping[int, SparseDictionary] | CrossLayerTranscoder,
                 ids: torch.Tensor, embed: str | None = None,
                 forward_kwargs: Mapping[str, Any] | None = None) -> None:
        self.clt: CrossLayerTranscoder | None = None
        if isinstance(transcoders, CrossLayerTranscoder):
            self.clt = transcoders
            views = clt_layer_views(self.clt, *clt_nodes(self.clt, pg=pg))
            _check_inputs(pg, {}, ids, views)
            nodes = {layer: (view.config.input_node, view.config.output_node) for layer, view in views.items()}
        else:
            _check_inputs(pg, transcoders, ids)
            nodes = {layer: dictionary_nodes(transcoder) for layer, transcoder in transcoders.items()}
        self.pg = pg
        self.ids = ids
        self.forward_kwargs = dict(forward_kwargs or {})
        self.embed = embed or detect_layout(pg).embed
        check_paths(pg, nodes, ids, self.embed, self.forward_kwargs)
        self.frozen: FrozenNodes = find_frozen_nodes(pg)
        self.layers: dict[int, SplicedLayer] = {}
        self.frozen_values: dict[str, torch.Tensor] = {}
        self.layer_norm_values: list[tuple[FrozenLayerNorm, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self.linearised_values: list[tuple[LinearisedOp, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        #: SDPA calls with their frozen pattern A⁰ ``[1, heads, query, key]``.
        self.pattern_values: list[tuple[FrozenPattern, torch.Tensor]] = []
        self.embeddings = torch.empty(0)
        self.logits = torch.empty(0)
        if self.clt is not None:
            self._record({}, views)
        else:
            self._record(dict(sorted(transcoders.items())))

    def _record(self, transcoders: dict[int, SparseDictionary],
                views: Mapping[int, CLTLayerView] | None = None) -> None:
        """One forward pass of the prompt with the transcoders (or the CLT of ``views``) spliced, error terms
        kept: x, a, e, c per layer, the frozen values, the embeddings and the logits."""
        patch_map: dict[str, list[Patch]] = {}
        op_paths = [path for op in (*self.frozen.layer_norms, *self.frozen.linearised)
                      for path in (op.input, op.output)]
        masks = [pattern.mask for pattern in self.frozen.patterns if pattern.mask is not None]
        probes = {path: ProbePatch() for path in (*self.frozen.paths, *op_paths, *masks, self.embed)}
        splices: dict[int, Any] = {}
        inputs: dict[int, ProbePatch] = {}
        outputs: dict[int, ProbePatch] = {}
        for layer, transcoder in transcoders.items():
            splices[layer] = splice(self.pg, transcoder)
            for path, patches in splices[layer].patch_map().items():
                patch_map.setdefault(path, []).extend(patches)
            inputs[layer], outputs[layer] = ProbePatch(), ProbePatch()
            patch_map[splices[layer].input_node].append(inputs[layer])
            patch_map[splices[layer].output_node].append(outputs[layer])  # after the splice: y, bit for bit
        clt_splice = splice_clt(self.pg, self.clt) if self.clt is not None and views else None
        if clt_splice is not None:
            for path, patches in clt_splice.patch_map().items():
                patch_map.setdefault(path, []).extend(patches)
            for layer, view in (views or {}).items():
                inputs[layer], outputs[layer] = ProbePatch(), ProbePatch()
                patch_map[view.config.input_node].append(inputs[layer])
                patch_map[view.config.output_node].append(outputs[layer])
        for path, probe in probes.items():
            patch_map.setdefault(path, []).append(probe)
        with torch.no_grad(), self.pg.patch(patch_map):
            self.logits = self.pg(self.ids, **self.forward_kwargs).logits.detach()
        self.frozen_values = {path: probes[path].activation for path in self.frozen.paths}
        self.embeddings = probes[self.embed].activation
        for norm in self.frozen.layer_norms:  # (norm, x⁰, y⁰, σ⁰)
            x0 = probes[norm.input].activation
            self.layer_norm_values.append((norm, x0, probes[norm.output].activation, norm.scale(x0)))
        for op in self.frozen.linearised:  # (op, z⁰, y⁰, f′(z⁰))
            z0 = probes[op.input].activation
            self.linearised_values.append((op, z0, probes[op.output].activation, op.slope(z0)))
        with torch.no_grad():
            for pattern in self.frozen.patterns:
                mask = probes[pattern.mask].activation if pattern.mask is not None else None
                self.pattern_values.append((pattern, pattern.pattern(probes[pattern.query].activation,
                                                                     probes[pattern.key].activation, mask)))
        with torch.no_grad():
            for layer, transcoder in transcoders.items():
                x, a = inputs[layer].activation, splices[layer].latents
                decoded = transcoder.decode(a)
                skip = transcoder.skip(x)
                output = decoded if skip is None else decoded + skip
                y = outputs[layer].activation
                self.layers[layer] = SplicedLayer(transcoder, splices[layer].input_node, splices[layer].output_node,
                                                  x, a, y - output, y, decoded + (y - output))
            if clt_splice is not None and self.clt is not None and views:
                self._record_clt(self.clt, views, clt_splice.latents, inputs, outputs)

    def _record_clt(self, clt: CrossLayerTranscoder, views: Mapping[int, CLTLayerView],
                    latents: Sequence[torch.Tensor | None], inputs: Mapping[int, ProbePatch],
                    outputs: Mapping[int, ProbePatch]) -> None:
        """The :class:`SplicedLayer` of each CLT layer from the recording pass: e_ℓ = y_ℓ − (Σ_{s ≤ ℓ} a_s
        W_dec[s → ℓ] + b_dec[ℓ] + x_ℓ W_skip[ℓ]ᵀ), c_ℓ = y_ℓ − x_ℓ W_skip[ℓ]ᵀ (as :func:`splice_clt`'s error term)."""
        recorded = [a for a in latents if a is not None]  # every layer's, after the pass
        for layer, view in views.items():
            x, y = inputs[layer].activation, outputs[layer].activation
            decoded = clt.decode(view.index, recorded)
            skip = view.skip(x)
            output = decoded if skip is None else decoded + skip
            self.layers[layer] = SplicedLayer(view, view.config.input_node, view.config.output_node, x,
                                              recorded[view.index], y - output, y, decoded + (y - output))

    def recorded_tensors(self) -> list[torch.Tensor]:
        """Every tensor the recording pass left held here, which :meth:`run` reads without copying (at the whole
        prompt's length): the frozen values, the normalisations' and linearised ops' values, the attention patterns,
        the embeddings, the logits, and each spliced layer's x, a, e, y and c."""
        found = [*self.frozen_values.values(), self.embeddings, self.logits]
        found += [t for values in (*self.layer_norm_values, *self.linearised_values) for t in values[1:]]
        found += [pattern for _, pattern in self.pattern_values]
        found += [t for spliced in self.layers.values()
                  for t in (spliced.inputs, spliced.activations, spliced.errors, spliced.outputs, spliced.constant)]
        return [t for t in found if isinstance(t, torch.Tensor)]

    def run(self, batch: int = 1, deltas: Mapping[int, torch.Tensor] | None = None,
            embed_delta: torch.Tensor | None = None,
            patches: Mapping[str, Sequence[Patch]] | None = None, length: int | None = None) -> ReplacementRun:
        """One forward pass of the replacement model on ``batch`` copies of the prompt (or of its first ``length``
        positions).

        Args:
            batch: rows (each a copy of the prompt; rows are independent, so one backward pass of a sum of per-row
                targets gives each row's gradients).
            deltas: layer -> δ_ℓ ``[batch or 1, seq, d_out]`` added to the MLP output (zero when absent).
            embed_delta: δ_E ``[batch or 1, seq, d_model]`` added to the token embeddings.
            patches: more patches, NodePath -> patches applied after the replacement model's own.
            length: run the first ``length`` positions alone (2 ≤ ``length`` ≤ seq; ``None``: every position; the
                ``seq`` of ``deltas`` and ``embed_delta`` is then ``length``). The model is causal, so these
                positions' values are the whole prompt's; every recorded value is cut to them (a frozen node's
                along each dimension where it is longer than the live value: the positions, and both of an
                attention pattern's).

        Returns:
            A :class:`ReplacementRun` (runs with autograd on: take gradients of it).

        Raises:
            CircuitError: ``length`` outside 2..seq (a 1-position run would need graphs of its own).
        """
        seq = self.ids.shape[1]
        if length is None:
            length = seq
        elif not 2 <= length <= seq:
            raise CircuitError(f"length={length}: give 2 to {seq} positions of the prompt (or None for all)")
        def first(recorded: torch.Tensor) -> torch.Tensor:  # a recorded [1, seq, ...] at the positions run
            return recorded if length == seq else recorded[:, :length]

        deltas = dict(deltas or {})
        patch_map: dict[str, list[Patch]] = {
            path: [ReplacePatch(value=value) if length == seq
                   else CustomPatch(custom_op=frozen_op(value), requires_clone=False)]
            for path, value in self.frozen_values.items()}
        if embed_delta is not None:
            patch_map.setdefault(self.embed, []).append(AddPatch(value=embed_delta))
        for norm, x0, y0, sigma0 in self.layer_norm_values:
            reader = HoldPatch()
            patch_map.setdefault(norm.input, []).append(reader)
            frozen = CustomPatch(custom_op=layer_norm_op(norm, reader, *map(first, (x0, y0, sigma0))),
                                 requires_clone=False)
            patch_map.setdefault(norm.output, []).append(frozen)
        for op, z0, y0, slope in self.linearised_values:
            reader = HoldPatch()
            patch_map.setdefault(op.input, []).append(reader)
            tangent = CustomPatch(custom_op=linearised_op(reader, *map(first, (z0, y0, slope))),
                                  requires_clone=False)
            patch_map.setdefault(op.output, []).append(tangent)
        for pattern, a0 in self.pattern_values:
            if pattern.query in self.frozen_values and pattern.key in self.frozen_values:
                reader = HoldPatch()
                patch_map.setdefault(pattern.value, []).append(reader)
                cut = a0 if length == seq else a0[:, :, :length, :length].contiguous()
                mixed = CustomPatch(custom_op=pattern_op(reader, cut), requires_clone=False)
                patch_map.setdefault(pattern.output, []).append(mixed)
        readers: dict[int, TranscoderInput] = {}
        for layer, spliced in self.layers.items():
            readers[layer] = TranscoderInput(width=spliced.transcoder.d_in)
            patch_map.setdefault(spliced.input_node, []).append(readers[layer])
            output = CustomPatch(custom_op=output_op(spliced, readers[layer], deltas.get(layer), first),
                                 requires_clone=False)
            patch_map.setdefault(spliced.output_node, []).append(output)
        for path, extra in (patches or {}).items():
            patch_map.setdefault(path, []).extend(extra)
        for spliced in self.layers.values():  # after every reader of the live input
            if self._runs_alone(spliced):
                patch_map[spliced.input_node].append(
                    CustomPatch(custom_op=recorded_op(spliced.inputs[:, :0]), requires_clone=False))
        ids = self.ids[:, :length]
        if batch > 1:  # the graphs of batched calls, extracted on two rows (not on the batch) and without a warning
            self.pg.prepare(ids.expand(2, -1), **self.forward_kwargs)
        with self.pg.patch(patch_map):
            logits = self.pg(ids.expand(batch, -1), **self.forward_kwargs).logits
        return ReplacementRun(logits, {layer: readers[layer].held for layer in self.layers},
                              {layer: spliced.transcoder for layer, spliced in self.layers.items()})

    def _runs_alone(self, spliced: SplicedLayer) -> bool:
        """Whether the transcoder reads the input of the graph whose output it writes (``<mlp>.x`` and
        ``<mlp>.output``, the graph's one input): the MLP's own computation, whose result is replaced, can then run
        on no position."""
        graph, _, leaf = spliced.output_node.rpartition(".")
        if leaf != "output" or spliced.input_node.rpartition(".")[0] != graph:
            return False
        inputs = [child for child in self.pg.node(graph) if child.op_name.startswith("placeholder")]
        return [child._path for child in inputs] == [spliced.input_node]


def _check_inputs(pg: PatchableGraph, transcoders: Mapping[int, SparseDictionary], ids: torch.Tensor,
                  views: Mapping[int, CLTLayerView] | None = None) -> None:
    """Raise (see :class:`ReplacementModel`) unless the transcoders (or the CLT layers ``views``) and the prompt
    fit the model."""
    if not transcoders and not views:
        raise CircuitError("give at least one transcoder (layer -> Transcoder)")
    if ids.dim() != 2 or ids.shape[0] != 1:
        raise CircuitError(f"an attribution graph is of one prompt: give ids [1, seq], got {tuple(ids.shape)}")
    config = getattr(pg.wrapped_model, "config", None)
    context = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if context is not None and ids.shape[1] > context:
        raise CircuitError(f"the prompt has {ids.shape[1]} tokens, more than the model's context of {context}; "
                           f"shorten it")
    fingerprint = None
    for layer, view in (views or {}).items():
        if view.config.model_fingerprint is not None:
            fingerprint = fingerprint or model_fingerprint(pg.wrapped_model)
            if view.config.model_fingerprint != fingerprint:
                raise FingerprintMismatchError(f"the cross-layer transcoder was trained on a model with fingerprint "
                                               f"{view.config.model_fingerprint}, but this model's is {fingerprint}: "
                                               f"load the CLT of this model")
    for layer, transcoder in transcoders.items():
        recorded = transcoder.config
        if recorded.kind == "sae":
            raise CircuitError(f"layer {layer}: give a transcoder whose config names its input_node and output_node "
                               f"(the MLP's input and output), not a {recorded.kind} at {recorded.input_node}")
        dictionary_nodes(transcoder, pg=pg)
        if recorded.model_fingerprint is not None:
            fingerprint = fingerprint or model_fingerprint(pg.wrapped_model)
            if recorded.model_fingerprint != fingerprint:
                raise FingerprintMismatchError(f"the transcoder of layer {layer} was trained on a model with "
                                               f"fingerprint {recorded.model_fingerprint}, but this model's is "
                                               f"{fingerprint}: load the transcoders of this model")
