"""Training a cross-layer transcoder (CLT, :class:`gradpatch.dictionaries.CrossLayerTranscoder`) in Lightning on
activations streamed from a frozen PatchableGraph: every layer from one forward pass.

Each step reads every layer's input and output node in one pass of the frozen graph (stopping after the deepest),
through the shuffle buffer of :class:`~recipes.dictionary.streaming.StreamingModule`, and minimises the local loss of
Ameisen et al. 2025 ("Circuit Tracing: Revealing Computational Graphs in Language Models",
transformer-circuits.pub/2025/attribution-graphs/methods.html, section "Building an interpretable replacement model",
and its appendix on CLT training):

- reconstruction, summed over the output layers: Σ_l′ FVU_l′, FVU_l′ = ‖ŷ_l′ − y_l′‖² / ‖y_l′ − mean(y_l′)‖² over the
  step's tokens, ŷ_l′ from the latents of layers 0..l′ (plus the skip term of a skip CLT). The paper sums the squared
  errors over layers on activations normalised per layer; dividing each layer's error by its own target variance is
  that per-layer normalisation (a model's MLP outputs grow by orders of magnitude with depth, and a plain sum would
  train the last layers only);
- JumpReLU and ReLU: + λ · Σ_l Σ_i tanh(c · ‖W_dec,l,i‖ · a_l,i), ‖W_dec,l,i‖ the norm of latent (l, i)'s decoder
  vectors into every output layer concatenated (:func:`gradpatch.dictionaries.tanh_penalty`), with λ ramped up over
  ``sparsity_warmup_steps`` (the paper ramps λ up during training); + λ_P · Σ_l Σ_i ReLU(θ_l,i − h_l,i)
  ‖W_dec,l,i‖, the pre-activation loss against dead latents (Anthropic's January 2025 update,
  :func:`~gradpatch.dictionaries.pre_activation_loss`); JumpReLU's threshold learns through the straight-through
  estimator (Rajamanoharan et al. 2024);
- TopK (the variant: k latents per token and layer): + α · AuxK over the dead latents of every layer
  (:func:`~gradpatch.dictionaries.cross_layer_auxk_loss`, Gao et al. 2024's α = 1/32, k_aux = d_out / 2).

Decoders are left unconstrained (the penalty weighs their norms). Logged every step: ``fvu`` (the mean over layers),
``l0`` (active latents per token and layer, the mean), ``dead_fraction``, the loss terms, and ``fvu``, ``l0`` and
``dead_fraction`` per output node (``fvu/<node>``); every ``ce_every_n_steps``, ``ce_increase``: the CE of the model
with every layer spliced at once, without error terms, minus the model's, on the step's batch. At the end of fit the
CLT is written with :func:`gradpatch.dictionaries.save_clt` to ``<default_root_dir>/dictionary``.

:class:`CLTFitModule` builds the CLT from a :class:`CLTSpec` (``gradpatch fit`` with a ``clt:`` section,
``recipes/configs/clt_smollm2.yaml``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from gradpatch.capture import node_activations
from gradpatch.dictionaries import (CLTConfig, CrossLayerTranscoder, DictionaryLayers, cross_layer_auxk_loss,
                                    cross_layer_layers, normalized_mse, pre_activation_loss, save_clt, sparse_decode,
                                    tanh_penalty)
from gradpatch.model_io import model_device

from ..errors import RecipeConfigError
from ..training.frozen import DtypeName, EMBEDDED_MODEL_LABEL, OptimizerName
from .module import AUXK_COEFFICIENT
from .spliced import spliced_ce_increase
from .streaming import BDecInit, StreamingModule

__all__ = ["CLTFitModule", "CLTSpec", "CrossLayerTranscoderModule", "PRE_ACTIVATION_COEFFICIENT", "build_clt"]

#: λ_P of the pre-activation loss (Anthropic's January 2025 update: 3e-6).
PRE_ACTIVATION_COEFFICIENT = 3e-6


class CrossLayerTranscoderModule(StreamingModule):
    """Train a cross-layer transcoder on the activations of ``pg`` (module docstring).

    Args:
        pg: the :class:`gradpatch.PatchableGraph` (frozen by this module).
        clt: the :class:`~gradpatch.dictionaries.CrossLayerTranscoder`; its config's ``input_nodes`` and
            ``output_nodes`` name the nodes read.
        buffer_rows, lr, optimizer, seed, b_dec_init, lr_warmup_steps, lr_decay_fraction, sparsity_warmup_steps,
            dead_after_tokens, auxk_coefficient, ce_every_n_steps: as :class:`~recipes.dictionary.DictionaryModule`
            (``b_dec`` of each output layer from its targets).
        sparsity_coefficient: λ of the tanh penalty (JumpReLU, ReLU).
        tanh_scale: c inside the tanh, in inverse units of the output activations.
        pre_activation_coefficient: λ_P of the pre-activation loss (JumpReLU, ReLU; 0: none).

    Raises:
        RecipeConfigError: a config without ``input_nodes`` / ``output_nodes``, a non-positive ``buffer_rows``,
            ``dead_after_tokens`` or ``tanh_scale``, a negative coefficient or ``ce_every_n_steps``, and as
            :class:`~recipes.dictionary.streaming.StreamingModule`.
    """

    def __init__(self, pg: Any, clt: CrossLayerTranscoder, buffer_rows: int = 65536, lr: float = 2e-4,
                 optimizer: OptimizerName = "adam", sparsity_coefficient: float = 1e-3, tanh_scale: float = 1.0,
                 pre_activation_coefficient: float = PRE_ACTIVATION_COEFFICIENT,
                 auxk_coefficient: float = AUXK_COEFFICIENT, dead_after_tokens: int = 10_000_000, seed: int = 0,
                 ce_every_n_steps: int = 50, b_dec_init: BDecInit = "mean", lr_warmup_steps: int = 0,
                 lr_decay_fraction: float = 0.0, sparsity_warmup_steps: int = 0) -> None:
        config = clt.config
        if not config.input_nodes or not config.output_nodes:
            raise RecipeConfigError("the CLT's config names no input_nodes / output_nodes: give the NodePaths it reads "
                                    "and writes (CLTConfig(input_nodes=[...], output_nodes=[...]))")
        if dead_after_tokens < 1 or not tanh_scale > 0 or ce_every_n_steps < 0 \
                or min(sparsity_coefficient, pre_activation_coefficient, auxk_coefficient) < 0:
            raise RecipeConfigError(f"dead_after_tokens ({dead_after_tokens}) and tanh_scale ({tanh_scale}) must be "
                                    f"positive, ce_every_n_steps ({ce_every_n_steps}) and the coefficients >= 0")
        nodes = list(dict.fromkeys(list(config.input_nodes) + list(config.output_nodes)))
        super().__init__(pg, nodes, config.exclude_first_positions, buffer_rows, lr, optimizer, seed, b_dec_init,
                         lr_warmup_steps, lr_decay_fraction, sparsity_warmup_steps)
        self.clt = clt
        self.sparsity_coefficient = float(sparsity_coefficient)
        self.tanh_scale = float(tanh_scale)
        self.pre_activation_coefficient = float(pre_activation_coefficient)
        self.auxk_coefficient = float(auxk_coefficient)
        self.dead_after_tokens = int(dead_after_tokens)
        self.ce_every_n_steps = int(ce_every_n_steps)
        self.register_buffer("tokens_since_fired", torch.zeros(config.n_layers, config.d_sae, dtype=torch.long))

    def layer_stack(self) -> DictionaryLayers:
        """The CLT as :class:`gradpatch.dictionaries.DictionaryLayers` (:func:`~gradpatch.dictionaries.evaluate_layers`
        scores it; ``metrics.json``)."""
        return cross_layer_layers(self.clt)

    def columns(self, rows: torch.Tensor, node: str) -> torch.Tensor:
        """``node``'s columns of ``rows`` ``[n, Σ widths]`` (the nodes in :attr:`nodes` order)."""
        inputs = set(self.clt.config.input_nodes)
        widths = [self.clt.d_in if name in inputs else self.clt.d_out for name in self.nodes]
        start = sum(widths[:self.nodes.index(node)])
        return rows[:, start:start + widths[self.nodes.index(node)]]

    def initialize_from_rows(self, rows: torch.Tensor) -> None:
        """Set ``b_dec[l]`` from output layer l's targets in the first drawn ``rows`` (``b_dec_init``)."""
        for layer, node in enumerate(self.clt.config.output_nodes):
            self.clt.b_dec[layer].copy_(self.data_center(self.columns(rows, node)).to(self.clt.b_dec))

    def decoder_norms(self) -> list[torch.Tensor]:
        """‖W_dec,l,i‖ per layer ``[m]``: the norm of latent (l, i)'s decoders into every output layer concatenated."""
        return [W.flatten(1).norm(dim=-1) for W in self.clt.W_dec]

    def loss_terms(self, rows: torch.Tensor) -> dict[str, torch.Tensor]:
        """The local loss on ``rows`` ``[n, Σ widths]`` (module docstring): ``{"loss", "reconstruction", "fvu",
        "l0", "dead_fraction", "penalty" and "pre_activation" or "auxk", "fvu/<node>", ...}``."""
        clt, config = self.clt, self.clt.config
        xs = [self.columns(rows, node) for node in config.input_nodes]
        ys = [self.columns(rows, node) for node in config.output_nodes]
        hs = [clt.pre_activations(layer, x) for layer, x in enumerate(xs)]
        if config.activation == "topk":
            zs, predictions = self.topk_outputs(xs, hs)
        else:
            zs = [clt.activate(layer, h) for layer, h in enumerate(hs)]
            predictions = [clt.output(layer, xs[layer], zs) for layer in range(config.n_layers)]
        fvus = [normalized_mse(p, y) for p, y in zip(predictions, ys)]
        dead = self.track_firing(zs)
        terms: dict[str, torch.Tensor] = {"reconstruction": torch.stack(fvus).sum()}
        loss = terms["reconstruction"]
        if config.activation == "topk":
            terms["auxk"] = cross_layer_auxk_loss(hs, [y - p for y, p in zip(ys, predictions)], list(clt.W_dec), dead,
                                                  max(clt.d_out // 2, 1))
            loss = loss + self.auxk_coefficient * terms["auxk"]
        else:
            norms = self.decoder_norms()
            thresholds = clt.threshold if config.activation == "jumprelu" else torch.zeros(config.n_layers, 1)
            terms["penalty"] = torch.stack([tanh_penalty(z, norm, self.tanh_scale) for z, norm in zip(zs, norms)]).sum()
            terms["pre_activation"] = torch.stack([pre_activation_loss(h, thresholds[layer].to(h), norm)
                                                   for layer, (h, norm) in enumerate(zip(hs, norms))]).sum()
            loss = (loss + self.sparsity_coefficient * self.sparsity_scale() * terms["penalty"]
                    + self.pre_activation_coefficient * terms["pre_activation"])
        l0s = [(z > 0).float().sum(-1).mean().detach() for z in zs]
        dead_fractions = (self.tokens_since_fired > self.dead_after_tokens).float().mean(-1)
        terms.update({"fvu": torch.stack(fvus).mean(), "l0": torch.stack(l0s).mean(),
                      "dead_fraction": dead_fractions.mean()})
        for layer, node in enumerate(config.output_nodes):
            terms.update({f"fvu/{node}": fvus[layer], f"l0/{node}": l0s[layer],
                          f"dead_fraction/{node}": dead_fractions[layer]})
        terms["loss"] = loss
        self.log_terms(terms)
        return terms

    def topk_outputs(self, xs: list[torch.Tensor],
                     hs: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """TopK's latents (detached, for the firing statistics) ``[n, m]`` per layer, and every output ŷ_l′
        ``[n, d_out]`` (``clt.output``'s value) decoded from each layer's k active latents only
        (:func:`gradpatch.dictionaries.sparse_decode`: n·k·Σ_l (L − l)·d multiply-adds instead of n·m·Σ_l (L − l)·d,
        36 times fewer for SmolLM2 at k = 32, m = 1,152)."""
        clt, count = self.clt, self.clt.n_layers
        outputs = [clt.b_dec[layer].expand(hs[0].shape[0], -1) for layer in range(count)]
        zs = []
        for layer, h in enumerate(hs):
            values, indices = h.topk(int(clt.config.k), dim=-1, sorted=False)  # activations.topk's choice
            values = values.relu()
            zs.append(torch.zeros_like(h, requires_grad=False).scatter(-1, indices, values.detach()))
            block = clt.W_dec[layer]
            decoded = sparse_decode(indices, values, block.flatten(1)).unflatten(-1, block.shape[1:])
            for offset in range(count - layer):
                outputs[layer + offset] = outputs[layer + offset] + decoded[:, offset]
        if clt.config.skip:
            outputs = [y + clt.skip_term(layer, xs[layer]) for layer, y in enumerate(outputs)]
        return zs, outputs

    def track_firing(self, zs: list[torch.Tensor]) -> torch.Tensor:
        """Count each layer's latents ``[n, m]`` into :attr:`tokens_since_fired` (0 for those that fired); returns
        the dead latents ``[L, m]`` (booleans)."""
        with torch.no_grad():
            since = self.tokens_since_fired
            since += zs[0].shape[0]
            for layer, z in enumerate(zs):
                since[layer][(z > 0).any(0)] = 0
        return since > self.dead_after_tokens

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        """After an optimizer step, every ``ce_every_n_steps``: ``ce_increase`` with every layer spliced at once on
        the step's batch, to each logger at this step."""
        if outputs is None or not self.ce_every_n_steps or self.global_step % self.ce_every_n_steps:
            return
        ids = batch["input_ids"] if isinstance(batch, dict) else batch
        value = float(spliced_ce_increase(self.graph, self.layer_stack(), ids))
        for logger in self.loggers:
            logger.log_metrics({"ce_increase": value}, step=self.global_step)

    def save_dictionaries(self, folder: Path) -> None:
        """Write the CLT to ``folder`` (:func:`gradpatch.dictionaries.save_clt`, with the model's fingerprint)."""
        save_clt(self.clt, folder, model=self.graph.wrapped_model)


@dataclass
class CLTSpec:
    """The cross-layer transcoder to train (``clt:`` of a ``gradpatch fit`` config).

    Attributes:
        input_node, output_node: NodePath templates with ``{layer}`` or parts of the model's layout (``mlp_input``,
            ``mlp``), as :class:`~recipes.dictionary.DictionarySpec` with ``layers``.
        layers: ``"all"`` or block indices (strictly increasing).
        activation: ``"jumprelu"`` (Ameisen et al.), ``"topk"`` or ``"relu"``.
        k: active latents per token and layer (TopK).
        expansion_factor: latents per layer per input dimension, unless ``d_sae`` is given.
        d_sae: latents per layer.
        skip: a linear skip term per layer.
        exclude_first_positions: positions left out (2 for SmolLM2's attention sinks).
    """

    input_node: str = "mlp_input"
    output_node: str = "mlp"
    layers: Literal["all"] | list[int] = "all"
    activation: Literal["jumprelu", "topk", "relu"] = "jumprelu"
    k: int | None = None
    expansion_factor: int = 4
    d_sae: int | None = None
    skip: bool = False
    exclude_first_positions: int = 0


def build_clt(pg: Any, spec: CLTSpec, seed: int = 0) -> CrossLayerTranscoder:
    """A freshly initialised CLT of ``spec`` whose widths are its nodes' in ``pg`` (one short forward pass).

    Raises:
        RecipeConfigError, LayoutError: as :func:`~recipes.dictionary.fit.layer_nodes`.
        NodePathError: a NodePath the graph lacks.
        DictionaryConfigError: an invalid combination.
    """
    from .fit import layer_nodes

    inputs, outputs = layer_nodes(pg, spec.input_node, spec.layers), layer_nodes(pg, spec.output_node, spec.layers)
    example = torch.ones(2, 2, dtype=torch.long, device=model_device(pg))
    d_in, d_out = (int(a.shape[-1]) for a in node_activations(pg, [inputs[0], outputs[0]], example))
    indices = _layer_indices(pg, spec.layers)
    config = CLTConfig(spec.activation, len(inputs), d_in, spec.d_sae or spec.expansion_factor * d_in, d_out=d_out,
                       k=spec.k if spec.activation == "topk" else None, skip=spec.skip, input_nodes=inputs,
                       output_nodes=outputs, layers=indices, exclude_first_positions=spec.exclude_first_positions)
    return CrossLayerTranscoder(config, generator=torch.Generator().manual_seed(seed))


def _layer_indices(pg: Any, layers: Literal["all"] | list[int]) -> list[int]:
    """The block indices of ``layers`` (``"all"``: every block of ``pg``'s layout)."""
    if layers != "all":
        return list(layers)
    from gradpatch.layouts import count_layers, detect_layout

    return list(range(count_layers(pg, detect_layout(pg))))


class CLTFitModule(CrossLayerTranscoderModule):
    """A :class:`CrossLayerTranscoderModule` built from config fields: it loads the model and builds the CLT.

    Args:
        clt: what to train (:class:`CLTSpec`).
        model_path, dtype: as :class:`~recipes.dictionary.DictionaryFitModule`.
        The others: as :class:`CrossLayerTranscoderModule` (``seed`` also seeds the initial weights).

    Raises:
        RecipeConfigError, NodePathError, DictionaryConfigError, LayoutError: as :func:`build_clt` and
            :class:`CrossLayerTranscoderModule`.
    """

    def __init__(self, clt: CLTSpec, model_path: str | None = None, dtype: DtypeName = "float32",
                 buffer_rows: int = 8192, lr: float = 2e-4, optimizer: OptimizerName = "adam",
                 sparsity_coefficient: float = 1e-3, tanh_scale: float = 1.0,
                 pre_activation_coefficient: float = PRE_ACTIVATION_COEFFICIENT,
                 auxk_coefficient: float = AUXK_COEFFICIENT, dead_after_tokens: int = 10_000_000, seed: int = 0,
                 ce_every_n_steps: int = 50, b_dec_init: BDecInit = "mean", lr_warmup_steps: int = 0,
                 lr_decay_fraction: float = 0.0, sparsity_warmup_steps: int = 0) -> None:
        from .fit import load_graph

        pg, tokenizer = load_graph(model_path, dtype)
        super().__init__(pg, build_clt(pg, clt, seed), buffer_rows=buffer_rows, lr=lr, optimizer=optimizer,
                         sparsity_coefficient=sparsity_coefficient, tanh_scale=tanh_scale,
                         pre_activation_coefficient=pre_activation_coefficient, auxk_coefficient=auxk_coefficient,
                         dead_after_tokens=dead_after_tokens, seed=seed, ce_every_n_steps=ce_every_n_steps,
                         b_dec_init=b_dec_init, lr_warmup_steps=lr_warmup_steps, lr_decay_fraction=lr_decay_fraction,
                         sparsity_warmup_steps=sparsity_warmup_steps)
        self.tokenizer = tokenizer
        self.model_label = model_path or EMBEDDED_MODEL_LABEL
