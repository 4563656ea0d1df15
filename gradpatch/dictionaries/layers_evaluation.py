"""Evaluating dictionaries at many layers at once, with the metrics of :mod:`gradpatch.dictionaries.evaluation`.

:func:`evaluate_layers` scores dictionaries at many layers (per-layer transcoders or SAEs,
:func:`per_layer_dictionaries`; a cross-layer transcoder, :func:`cross_layer_layers`): each layer's
:class:`DictionaryMetrics` with that layer's dictionary spliced alone (the others' nodes as the model computes
them), and :class:`AllSplicedMetrics`, the CE losses and KL with every layer spliced at once, without error terms
(the replacement model's MLPs, for transcoders at every MLP), against every written node zero-ablated at once. One
pass of the model reads every node; a layer spliced alone writes the output its dictionary computes from that pass
(its input is upstream of its output, so splicing it alone does not change its input), so a batch costs
1 + 2 L + 2 forward passes for L layers instead of :func:`~gradpatch.dictionaries.evaluate_dictionary`'s 3 L.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ..patches import CustomPatch, HoldPatch, ProbePatch, ZeroPatch
from .evaluation import DictionaryMetrics, MetricSums, next_token_losses
from .modules import SparseDictionary

__all__ = ["AllSplicedMetrics", "DictionaryLayers", "LayerMetrics", "cross_layer_layers", "evaluate_layers",
           "per_layer_dictionaries", "splice_layers"]


@dataclass
class AllSplicedMetrics:
    """The model with every layer's dictionary spliced at once, without error terms (:func:`evaluate_layers`).

    Attributes:
        ce_loss_original: the model's mean next-token CE.
        ce_loss_spliced: with every dictionary spliced at once.
        ce_loss_zero_ablation: with every written node zero-ablated at once (at the spliced positions).
        ce_loss_recovered: (CE_zero − CE_spliced) / (CE_zero − CE_original), as :class:`DictionaryMetrics`'s.
        kl: mean KL(p_original ‖ p_spliced) over every position.
        n_layers: the layers spliced.
    """

    ce_loss_original: float
    ce_loss_spliced: float
    ce_loss_zero_ablation: float
    ce_loss_recovered: float
    kl: float
    n_layers: int

    def to_dict(self) -> dict[str, Any]:
        """The fields by name."""
        return asdict(self)


@dataclass
class LayerMetrics:
    """What :func:`evaluate_layers` returns: ``layers`` maps each written NodePath to its layer's
    :class:`DictionaryMetrics` (spliced alone), ``all_spliced`` the whole stack spliced at once."""

    layers: dict[str, DictionaryMetrics]
    all_spliced: AllSplicedMetrics


@dataclass
class DictionaryLayers:
    """Dictionaries that read ``input_nodes[l]`` and write ``output_nodes[l]`` for layers l = 0 .. L − 1, as
    :func:`evaluate_layers` splices them (built by :func:`per_layer_dictionaries` or :func:`cross_layer_layers`).

    Attributes:
        input_nodes, output_nodes: NodePaths per layer (the same node for an SAE), in forward order.
        encode: ``(l, x [..., d_in]) -> latents [..., m_l]``.
        output: ``(l, x_l [..., d_in], latents of layers 0..l) -> prediction [..., d_out]`` (a per-layer dictionary
            reads its own latents only; a cross-layer transcoder every earlier layer's).
        d_sae: latents per layer.
        exclude_first_positions: the positions left as the model computes them (attention sinks).
        modules: the modules switched to ``eval()`` during evaluation (BatchTopK's per-token threshold).
    """

    input_nodes: list[str]
    output_nodes: list[str]
    encode: Callable[[int, torch.Tensor], torch.Tensor]
    output: Callable[[int, torch.Tensor, list[torch.Tensor]], torch.Tensor]
    d_sae: list[int]
    exclude_first_positions: int
    modules: list[torch.nn.Module]


def per_layer_dictionaries(dictionaries: Sequence[SparseDictionary]) -> DictionaryLayers:
    """:class:`DictionaryLayers` of one SAE or transcoder per layer, each at its config's nodes, in the order given
    (the forward order of their nodes).

    Raises:
        DictionaryConfigError: a dictionary whose config names no node, or dictionaries that leave out different
            first positions.
    """
    from .errors import DictionaryConfigError
    from .splice import dictionary_nodes

    nodes = [dictionary_nodes(d) for d in dictionaries]
    excluded = {d.config.exclude_first_positions for d in dictionaries}
    if len(excluded) != 1:
        raise DictionaryConfigError(f"per_layer_dictionaries needs dictionaries that leave out the same first "
                                    f"positions, got exclude_first_positions {sorted(excluded)}")
    return DictionaryLayers(
        input_nodes=[read for read, _ in nodes], output_nodes=[write for _, write in nodes],
        encode=lambda layer, x: dictionaries[layer].encode(x),
        output=lambda layer, x, latents: dictionaries[layer].output(x, latents[layer]),
        d_sae=[d.d_sae for d in dictionaries], exclude_first_positions=excluded.pop(), modules=list(dictionaries))


def cross_layer_layers(clt: Any) -> DictionaryLayers:
    """:class:`DictionaryLayers` of a :class:`~gradpatch.dictionaries.CrossLayerTranscoder`: layer l reads
    ``config.input_nodes[l]`` and writes ``config.output_nodes[l]`` from the latents of layers 0..l
    (``clt.output(l, x_l, latents)``: the decoders of layers 0..l, plus the skip term of a skip CLT).

    Raises:
        DictionaryConfigError: a config without ``input_nodes`` or ``output_nodes``.
    """
    from .errors import DictionaryConfigError

    config = clt.config
    if not config.input_nodes or not config.output_nodes:
        raise DictionaryConfigError("the cross-layer transcoder's config names no input_nodes / output_nodes; set "
                                    "them (the NodePaths it reads and writes, one per layer)")
    return DictionaryLayers(input_nodes=list(config.input_nodes), output_nodes=list(config.output_nodes),
                            encode=clt.encode, output=clt.output, d_sae=[config.d_sae] * config.n_layers,
                            exclude_first_positions=config.exclude_first_positions, modules=[clt])


def evaluate_layers(pg: Any, layers: DictionaryLayers,
                    batches: Iterable[torch.Tensor | Mapping[str, Any]]) -> LayerMetrics:
    """Each layer's :class:`DictionaryMetrics` spliced alone and the whole stack's :class:`AllSplicedMetrics`
    (module docstring), over ``batches`` as :func:`evaluate_dictionary` takes them.

    Args:
        pg: the :class:`~gradpatch.PatchableGraph`.
        layers: the dictionaries per layer (:func:`per_layer_dictionaries`, :func:`cross_layer_layers`), on the
            model's device.
        batches: token ids ``[batch, seq]`` or mappings with ``input_ids`` (and ``attention_mask``).

    Returns:
        :class:`LayerMetrics`, its ``layers`` keyed by written NodePath in layer order.

    Raises:
        NodePathError: a NodePath the graph lacks.
    """
    from ..positions import Tokens

    first = layers.exclude_first_positions
    positions = Tokens(slice(first, None)) if first else None
    count = len(layers.output_nodes)
    sums = [MetricSums(1, m) for m in layers.d_sae]  # d_out is set from the first batch
    together = MetricSums(1, 1)
    modes = [module.training for module in layers.modules]
    for module in layers.modules:
        module.eval()
    try:
        with torch.no_grad():
            for batch in batches:
                inputs = dict(batch) if isinstance(batch, Mapping) else {"input_ids": batch}
                _add_layer_batch(pg, layers, positions, inputs, sums, together)
    finally:
        for module, mode in zip(layers.modules, modes):
            module.train(mode)
    ce = {name: value / max(together.positions, 1) for name, value in together.losses.items()}
    span = ce["zero"] - ce["original"]
    all_spliced = AllSplicedMetrics(
        ce_loss_original=ce["original"], ce_loss_spliced=ce["spliced"], ce_loss_zero_ablation=ce["zero"],
        ce_loss_recovered=(ce["zero"] - ce["spliced"]) / span if span != 0 else float("nan"),
        kl=together.kl / max(together.kl_positions, 1), n_layers=count)
    return LayerMetrics({node: one.metrics() for node, one in zip(layers.output_nodes, sums)}, all_spliced)


def _add_layer_batch(pg: Any, layers: DictionaryLayers, positions: Any, inputs: dict[str, Any], sums: list[MetricSums],
                     together: MetricSums) -> None:
    """One batch of :func:`evaluate_layers`: the original pass, each layer spliced alone and zero-ablated alone,
    every layer spliced and zero-ablated at once."""
    ids = inputs["input_ids"]
    mask = inputs.get("attention_mask", torch.ones_like(ids)).bool()
    scored = mask[:, :-1] & mask[:, 1:]
    counted = mask[:, layers.exclude_first_positions:]
    nodes = list(dict.fromkeys(layers.input_nodes + layers.output_nodes))
    probes = {node: ProbePatch(slice=positions) for node in nodes}
    pg.prepare(**inputs, use_cache=False)  # this batch's graphs, extracted without a warning the user cannot act on
    with pg.patch(probes):
        original = pg(**inputs, use_cache=False).logits

    def add_losses(target: MetricSums, name: str, logits: torch.Tensor) -> None:
        target.losses[name] += float(next_token_losses(logits, ids, scored))
        if name == "spliced":
            log_p, log_q = F.log_softmax(original.float(), -1), F.log_softmax(logits.float(), -1)
            target.kl += float(((log_p.exp() * (log_p - log_q)).sum(-1) * mask).sum())
            target.kl_positions += int(mask.sum())

    if ids.shape[1] <= layers.exclude_first_positions:  # nothing spliced: every pass is the original one
        for one in [*sums, together]:
            for name in ("original", "spliced", "zero"):
                add_losses(one, name, original)
            one.positions += int(scored.sum())
        return
    xs = [probes[node].activation for node in layers.input_nodes]
    latents: list[torch.Tensor] = []
    for layer in range(len(xs)):
        latents.append(layers.encode(layer, xs[layer]))
    predictions = [layers.output(layer, xs[layer], latents) for layer in range(len(xs))]

    for layer, (node, one) in enumerate(zip(layers.output_nodes, sums)):
        y = probes[node].activation
        if counted.any():
            one.add_activations(y[counted], predictions[layer][counted].to(y.dtype), latents[layer][counted])
        replaced = _constant(predictions[layer], positions)
        with pg.patch({node: replaced}):
            add_losses(one, "spliced", pg(**inputs, use_cache=False).logits)
        with pg.patch({node: ZeroPatch(slice=positions)}):
            add_losses(one, "zero", pg(**inputs, use_cache=False).logits)
        add_losses(one, "original", original)
        one.positions += int(scored.sum())
    with splice_layers(pg, layers):
        add_losses(together, "spliced", pg(**inputs, use_cache=False).logits)
    with pg.patch({node: ZeroPatch(slice=positions) for node in layers.output_nodes}):
        add_losses(together, "zero", pg(**inputs, use_cache=False).logits)
    add_losses(together, "original", original)
    together.positions += int(scored.sum())


def _constant(value: torch.Tensor, positions: Any) -> CustomPatch:
    """A patch that writes ``value`` (cast to the node's dtype) at ``positions``."""
    return CustomPatch(custom_op=lambda original: value.to(original.dtype), slice=positions, requires_clone=False)


@contextmanager
def splice_layers(pg: Any, layers: DictionaryLayers) -> Iterator[None]:
    """Every layer of ``layers`` spliced into ``pg`` at once, without error terms, for the ``with`` block (at
    positions ``exclude_first_positions``.. only): each layer's output node is written from its input node's value in
    the same pass (already changed by the layers spliced upstream) and the latents of the layers before it, as the
    replacement model computes it.

    Raises:
        NodePathError: a NodePath the graph lacks.
    """
    from ..positions import Tokens

    first = layers.exclude_first_positions
    positions = Tokens(slice(first, None)) if first else None
    latents: list[torch.Tensor] = []
    holds = {node: HoldPatch(slice=positions) for layer, node in enumerate(layers.input_nodes)
             if node != layers.output_nodes[layer]}

    def writer(layer: int) -> Callable[[torch.Tensor], torch.Tensor]:
        read = layers.input_nodes[layer]

        def write(original: torch.Tensor) -> torch.Tensor:
            x = original if read == layers.output_nodes[layer] else holds[read].held
            del latents[layer:]
            latents.append(layers.encode(layer, x))
            return layers.output(layer, x, latents).to(original.dtype)
        return write

    patches: dict[str, list[Any]] = {}
    for layer, node in enumerate(layers.output_nodes):
        patches.setdefault(node, []).append(CustomPatch(custom_op=writer(layer), slice=positions,
                                                        requires_clone=False))
    for node, hold in holds.items():  # after a writer at the same node: it reads the written value
        patches.setdefault(node, []).append(hold)
    with pg.patch(patches):
        yield
