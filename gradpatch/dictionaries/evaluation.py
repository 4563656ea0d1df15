"""Evaluating a dictionary on a model, as the field defines it (SAELens's metrics).

For batches of token ids, three forward passes each: the model as it is (probes read the dictionary's nodes), the
model with the dictionary spliced *without* its error term, and the model with the written node zero-ablated. Over
all tokens (positions where the attention mask is 1):

- ``fvu`` = Σ‖y − ŷ‖² / Σ‖y − mean(y)‖² (y the written node's value, ŷ the dictionary's output; the mean over all
  tokens); ``explained_variance`` = 1 − fvu;
- ``l0``: mean active latents per token; ``dead_fraction``: latents that fired on no token;
- ``ce_loss_original``, ``ce_loss_spliced``, ``ce_loss_zero_ablation``: the mean next-token cross-entropy over every
  position that has a next token; ``ce_loss_recovered`` = (CE_zero − CE_spliced) / (CE_zero − CE_original), SAELens's
  definition (NaN when zero ablation does not change the loss);
- ``kl``: mean of KL(p_original ‖ p_spliced) over every position of every sequence (the attention mask's), the CE
  losses' positions plus each sequence's last one, whose KL is defined without a next token (SAELens's
  ``kl_div_with_sae`` averages over the same positions);
- ``n_tokens``: the tokens counted in the activation metrics (``fvu`` .. ``dead_fraction``).

A dictionary whose config has ``exclude_first_positions`` n > 0 is spliced, and the node zero-ablated, at positions
n.. only (:func:`~gradpatch.dictionaries.trained_positions`; the first n keep the model's values), and its activation
metrics count those positions only. The CE losses and the KL still average over every position, the first n
included (there the spliced model is the model: they add 0 to the KL's sum and the same loss to each CE), so that
they compare with SAELens's and with runs that exclude nothing.

:meth:`DictionaryMetrics.to_dict` (``metrics.json``) holds each metric under our name and, for the five SAELens
reports, under SAELens's name too (:data:`SAELENS_NAMES`): the same numbers.

:func:`evaluate_layers` scores dictionaries at many layers at once (per-layer transcoders or SAEs,
:func:`per_layer_dictionaries`; a cross-layer transcoder, :func:`cross_layer_layers`): each layer's
:class:`DictionaryMetrics` with that layer's dictionary spliced alone (the others' nodes as the model computes
them), and :class:`AllSplicedMetrics`, the CE losses and KL with every layer spliced at once, without error terms
(the replacement model's MLPs, for transcoders at every MLP), against every written node zero-ablated at once. One
pass of the model reads every node; a layer spliced alone writes the output its dictionary computes from that pass
(its input is upstream of its output, so splicing it alone does not change its input), so a batch costs
1 + 2 L + 2 forward passes for L layers instead of :func:`evaluate_dictionary`'s 3 L.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ..patches import CustomPatch, HoldPatch, ProbePatch, ZeroPatch
from .modules import SparseDictionary
from .splice import Splice, splice, trained_positions

__all__ = ["AllSplicedMetrics", "DictionaryLayers", "DictionaryMetrics", "LayerMetrics", "SAELENS_NAMES",
           "cross_layer_layers", "evaluate_dictionary", "evaluate_layers", "per_layer_dictionaries", "splice_layers"]

#: SAELens's name of a metric (``sae_lens.evals.get_downstream_reconstruction_metrics``) -> our field of the same
#: number.
SAELENS_NAMES: dict[str, str] = {"ce_loss_without_sae": "ce_loss_original", "ce_loss_with_sae": "ce_loss_spliced",
                                 "ce_loss_with_ablation": "ce_loss_zero_ablation", "ce_loss_score": "ce_loss_recovered",
                                 "kl_div_with_sae": "kl"}


@dataclass
class DictionaryMetrics:
    """What :func:`evaluate_dictionary` measures (module docstring); :meth:`to_dict` gives the JSON keys."""

    fvu: float
    explained_variance: float
    l0: float
    dead_fraction: float
    ce_loss_original: float
    ce_loss_spliced: float
    ce_loss_zero_ablation: float
    ce_loss_recovered: float
    kl: float
    n_tokens: int

    def to_dict(self) -> dict[str, Any]:
        """The fields by name, then the same numbers under SAELens's names (:data:`SAELENS_NAMES`)."""
        fields = asdict(self)
        return {**fields, **{saelens: fields[ours] for saelens, ours in SAELENS_NAMES.items()}}


class _Sums:
    """Running float64 sums over tokens."""

    def __init__(self, d_out: int, d_sae: int) -> None:
        self.error = 0.0
        self.sum = torch.zeros(d_out, dtype=torch.float64)
        self.square = 0.0
        self.active = 0.0
        self.fired = torch.zeros(d_sae, dtype=torch.bool)
        self.tokens = 0
        self.losses = {"original": 0.0, "spliced": 0.0, "zero": 0.0}
        self.positions = 0
        self.kl = 0.0
        self.kl_positions = 0

    def add_activations(self, target: torch.Tensor, output: torch.Tensor, latents: torch.Tensor) -> None:
        target, output = target.double(), output.double()
        if self.tokens == 0:  # the width from the first tokens (evaluate_layers does not know it before)
            self.sum = torch.zeros(target.shape[-1], dtype=torch.float64)
        self.error += float((target - output).pow(2).sum())
        self.sum += target.sum(0).cpu()
        self.square += float(target.pow(2).sum())
        self.active += float((latents > 0).sum())
        self.fired |= (latents > 0).any(0).cpu()
        self.tokens += target.shape[0]

    def metrics(self) -> DictionaryMetrics:
        mean = self.sum / max(self.tokens, 1)
        variance = self.square - self.tokens * float(mean.pow(2).sum())
        fvu = self.error / variance if variance > 0 else float("nan")
        ce = {name: value / max(self.positions, 1) for name, value in self.losses.items()}
        span = ce["zero"] - ce["original"]
        return DictionaryMetrics(
            fvu=fvu, explained_variance=1.0 - fvu, l0=self.active / max(self.tokens, 1),
            dead_fraction=float((~self.fired).double().mean()), ce_loss_original=ce["original"],
            ce_loss_spliced=ce["spliced"], ce_loss_zero_ablation=ce["zero"],
            ce_loss_recovered=(ce["zero"] - ce["spliced"]) / span if span != 0 else float("nan"),
            kl=self.kl / max(self.kl_positions, 1), n_tokens=self.tokens)


def _next_token_losses(logits: torch.Tensor, ids: torch.Tensor, scored: torch.Tensor) -> torch.Tensor:
    """Σ of −log p(next token) over the ``scored`` positions ``[batch, seq − 1]`` (scalar)."""
    losses = F.cross_entropy(logits[:, :-1].float().flatten(0, 1), ids[:, 1:].flatten(), reduction="none")
    return (losses * scored.flatten()).sum()


def evaluate_dictionary(pg: Any, dictionary: SparseDictionary, batches: Iterable[torch.Tensor | Mapping[str, Any]],
                        node: str | None = None, output_node: str | None = None) -> DictionaryMetrics:
    """SAELens-style metrics of ``dictionary`` spliced into ``pg`` (module docstring).

    Args:
        pg: the :class:`~gradpatch.PatchableGraph` (its forward returns ``.logits``).
        dictionary: the SAE or transcoder (on the model's device).
        batches: token ids ``[batch, seq]``, or mappings with ``input_ids`` and optionally ``attention_mask``
            (passed to the model; masked positions are not counted).
        node, output_node: the NodePaths read and written (default: the dictionary's config's).

    Returns:
        The metrics over all batches.

    Raises:
        DictionaryConfigError, NodePathError, DictionaryShapeError: as :func:`~gradpatch.dictionaries.splice`.
    """
    spliced = splice(pg, dictionary, node, output_node=output_node, error_term=False,
                     slice=trained_positions(dictionary))
    sums = _Sums(dictionary.d_out, dictionary.d_sae)
    training = dictionary.training
    dictionary.eval()  # BatchTopK: per-token latents with its threshold, no update of it
    try:
        for batch in batches:
            inputs = dict(batch) if isinstance(batch, Mapping) else {"input_ids": batch}
            _add_batch(pg, spliced, inputs, sums)
    finally:
        dictionary.train(training)
    return sums.metrics()


def _add_batch(pg: Any, spliced: Splice, inputs: dict[str, Any], sums: _Sums) -> None:
    """The three forward passes of one batch, added to ``sums``."""
    ids = inputs["input_ids"]
    mask = inputs.get("attention_mask", torch.ones_like(ids)).bool()
    scored = mask[:, :-1] & mask[:, 1:]
    probes = {spliced.input_node: ProbePatch(), spliced.output_node: ProbePatch()}  # one probe when they coincide
    first = spliced.patch.dictionary.config.exclude_first_positions
    with torch.no_grad():
        with pg.patch(probes):
            original = pg(**inputs, use_cache=False).logits
        with pg.patch(spliced):
            logits = pg(**inputs, use_cache=False).logits
        with pg.patch({spliced.output_node: ZeroPatch(slice=spliced.patch.slice)}):
            zero = pg(**inputs, use_cache=False).logits
        counted = mask[:, first:]
        if counted.any():  # else a batch no longer than the excluded positions: nothing spliced, no latents
            x = probes[spliced.input_node].activation[:, first:][counted]
            y = probes[spliced.output_node].activation[:, first:][counted]
            latents = spliced.latents[counted]  # the spliced pass read the unchanged input node
            sums.add_activations(y, spliced.patch.dictionary.output(x, latents), latents)
        for name, value in (("original", original), ("spliced", logits), ("zero", zero)):
            sums.losses[name] += float(_next_token_losses(value, ids, scored))
        log_p, log_q = F.log_softmax(original.float(), -1), F.log_softmax(logits.float(), -1)
        sums.kl += float(((log_p.exp() * (log_p - log_q)).sum(-1) * mask).sum())
        sums.positions += int(scored.sum())
        sums.kl_positions += int(mask.sum())


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
    sums = [_Sums(1, m) for m in layers.d_sae]  # d_out is set from the first batch
    together = _Sums(1, 1)
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


def _add_layer_batch(pg: Any, layers: DictionaryLayers, positions: Any, inputs: dict[str, Any], sums: list[_Sums],
                     together: _Sums) -> None:
    """One batch of :func:`evaluate_layers`: the original pass, each layer spliced alone and zero-ablated alone,
    every layer spliced and zero-ablated at once."""
    ids = inputs["input_ids"]
    mask = inputs.get("attention_mask", torch.ones_like(ids)).bool()
    scored = mask[:, :-1] & mask[:, 1:]
    counted = mask[:, layers.exclude_first_positions:]
    nodes = list(dict.fromkeys(layers.input_nodes + layers.output_nodes))
    probes = {node: ProbePatch(slice=positions) for node in nodes}
    with pg.patch(probes):
        original = pg(**inputs, use_cache=False).logits

    def add_losses(target: _Sums, name: str, logits: torch.Tensor) -> None:
        target.losses[name] += float(_next_token_losses(logits, ids, scored))
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
