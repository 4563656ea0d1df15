"""Cross-layer transcoders (CLTs): ``L`` encoders, each reading one layer, whose latents write to that layer's output
and every later one (Ameisen et al. 2025, "Circuit Tracing: Revealing Computational Graphs in Language Models",
transformer-circuits.pub/2025/attribution-graphs/methods.html, section "Building an interpretable replacement
model", the CLT architecture).

CLT layer ``l`` (``0 ≤ l < L``) reads ``x_l`` ``[..., d_in]`` at ``input_nodes[l]`` (e.g. the MLP input of model layer
``layers[l]``) and the CLT predicts ``y_l'`` ``[..., d_out]`` at ``output_nodes[l']`` (that MLP's output)::

    a_l   = σ(x_l W_enc[l] + b_enc[l])                                W_enc [L, d_in, m], b_enc [L, m]
    ŷ_l'  = Σ_{l ≤ l'} a_l W_dec[l][:, l' − l] + b_dec[l']             W_dec[l] [m, L − l, d_out], b_dec [L, d_out]
            (+ x_l' W_skip[l']ᵀ with ``skip``)                         W_skip [L, d_out, d_in]

``m = d_sae`` latents per layer; σ is ReLU, TopK (per token and layer) or JumpReLU with a threshold ``[L, m]``
(:mod:`gradpatch.dictionaries.activations`). ``W_dec[l][i]`` ``[L − l, d_out]`` is latent ``(l, i)``'s decoder: its
direction in each output layer ``l..L−1``, the layout of circuit-tracer 0.5.0's ``CrossLayerTranscoder.W_dec``.

Initialisation (Ameisen et al. 2025, methods, appendix on CLT training): encoder weights U(−1/√m, 1/√m), decoder
weights U(−1/√(L·d_out), 1/√(L·d_out)), biases 0; JumpReLU θ = 0.001 (Rajamanoharan et al. 2024, section 5, as the
per-layer dictionaries); ``W_skip`` 0 (Paulo et al. 2025, arXiv 2501.18823, section 2).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from . import activations
from .errors import DictionaryConfigError, DictionaryShapeError
from .modules import THRESHOLD_INIT, config_from_dict

__all__ = ["CLT_ACTIVATIONS", "CLTConfig", "CrossLayerTranscoder"]

#: The activations a CLT accepts (BatchTopK's batch-dependent latents are not offered for CLTs).
CLT_ACTIVATIONS = ("relu", "jumprelu", "topk")


@dataclass
class CLTConfig:
    """What a cross-layer transcoder is (saved as JSON beside its tensors, as :class:`DictionaryConfig` is).

    Attributes:
        activation: ``"relu"``, ``"jumprelu"`` or ``"topk"``.
        n_layers: ``L``; CLT layer ``l`` reads ``input_nodes[l]`` and writes ``output_nodes[l]``.
        d_in: the width of every node read.
        d_sae: ``m``, the number of latents per layer (``L · m`` in all).
        d_out: the width of every node written (``None`` means ``d_in``).
        k: active latents per token and layer (TopK), ``None`` otherwise.
        bandwidth: ε of JumpReLU's straight-through estimator.
        skip: add a linear skip term ``x_l W_skip[l]ᵀ`` per layer.
        input_nodes: the ``L`` NodePaths read, if known.
        output_nodes: the ``L`` NodePaths written, if known.
        layers: the model layer of each CLT layer, strictly increasing (``None`` resolves to ``0..L−1``): what
            attribution graphs name the latents' nodes by.
        model_fingerprint: :func:`gradpatch.model_fingerprint` of the model it was trained on, if known.
        exclude_first_positions: positions at the start of every sequence left out of training and splicing
            (attention sinks; :class:`~gradpatch.dictionaries.DictionaryConfig`).
    """

    activation: str
    n_layers: int
    d_in: int
    d_sae: int
    d_out: int | None = None
    k: int | None = None
    bandwidth: float = 0.001
    skip: bool = False
    input_nodes: list[str] | None = None
    output_nodes: list[str] | None = None
    layers: list[int] | None = None
    model_fingerprint: str | None = None
    exclude_first_positions: int = 0

    def __post_init__(self) -> None:
        if self.d_out is None:
            self.d_out = self.d_in
        if self.layers is None and _positive_int(self.n_layers):
            self.layers = list(range(self.n_layers))
        for name in ("input_nodes", "output_nodes", "layers"):
            value = getattr(self, name)
            if isinstance(value, tuple):
                setattr(self, name, list(value))
        self.validate()

    def validate(self) -> None:
        """Raise :class:`DictionaryConfigError` (naming the fix) unless the fields describe a CLT."""
        if self.activation not in CLT_ACTIVATIONS:
            raise DictionaryConfigError(f"CLT activation {self.activation!r} is not one of {CLT_ACTIVATIONS}")
        for name in ("n_layers", "d_in", "d_sae", "d_out"):
            if not _positive_int(getattr(self, name)):
                raise DictionaryConfigError(f"{name} must be a positive int, got {getattr(self, name)!r}")
        if self.activation == "topk":
            if not isinstance(self.k, int) or not 1 <= self.k <= self.d_sae:
                raise DictionaryConfigError(f"topk needs k in 1..d_sae={self.d_sae}, got k={self.k!r}")
        elif self.k is not None:
            raise DictionaryConfigError(f"k={self.k} applies to topk only, not {self.activation}; leave k=None")
        if not self.bandwidth > 0:
            raise DictionaryConfigError(f"bandwidth must be > 0, got {self.bandwidth!r}")
        if not isinstance(self.skip, bool):
            raise DictionaryConfigError(f"skip must be True or False, got {self.skip!r}")
        if not isinstance(self.exclude_first_positions, int) or self.exclude_first_positions < 0:
            raise DictionaryConfigError(f"exclude_first_positions must be an int >= 0, got "
                                        f"{self.exclude_first_positions!r}")
        layers = self.layers
        if not isinstance(layers, list) or len(layers) != self.n_layers \
                or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in layers) \
                or any(a >= b for a, b in zip(layers, layers[1:])):
            raise DictionaryConfigError(f"layers must list the model layer of each of the n_layers={self.n_layers} "
                                        f"CLT layers, strictly increasing ints >= 0, got {layers!r}")
        for name in ("input_nodes", "output_nodes"):
            nodes = getattr(self, name)
            if nodes is not None and (not isinstance(nodes, list) or len(nodes) != self.n_layers
                                      or not all(isinstance(node, str) and node for node in nodes)):
                raise DictionaryConfigError(f"{name} must list one NodePath per CLT layer (n_layers="
                                            f"{self.n_layers}), got {nodes!r}")

    def to_dict(self) -> dict[str, Any]:
        """The fields as a JSON-ready dict."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, fields: dict[str, Any]) -> "CLTConfig":
        """The config of ``fields`` (unknown keys rejected).

        Raises:
            DictionaryConfigError: unknown or missing fields, or invalid values.
        """
        return config_from_dict(cls, fields, "CLT")


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


class CrossLayerTranscoder(nn.Module):
    """A cross-layer transcoder (module docstring): ``L`` encoders, decoders from each layer to it and every later one.

    Args:
        config: the CLT (activation, ``L``, widths, nodes).
        generator: random generator of the initial weights (module docstring).

    Attributes:
        W_enc: ``[L, d_in, m]``; ``b_enc``: ``[L, m]``; ``threshold``: ``[L, m]`` (JumpReLU only).
        W_dec: an ``nn.ParameterList``, ``W_dec[l]`` ``[m, L − l, d_out]``: layer ``l``'s latents to output layers
            ``l..L−1``.
        b_dec: ``[L, d_out]``; ``W_skip``: ``[L, d_out, d_in]`` when ``config.skip``.

    Raises:
        DictionaryConfigError: an invalid config.
    """

    def __init__(self, config: CLTConfig, generator: torch.Generator | None = None) -> None:
        super().__init__()
        config.validate()
        self.config = config
        n, d_in, m, d_out = config.n_layers, config.d_in, config.d_sae, self.d_out
        encoder_bound, decoder_bound = 1 / math.sqrt(m), 1 / math.sqrt(n * d_out)
        self.W_enc = nn.Parameter(_uniform((n, d_in, m), encoder_bound, generator))
        self.b_enc = nn.Parameter(torch.zeros(n, m))
        self.W_dec = nn.ParameterList([nn.Parameter(_uniform((m, n - layer, d_out), decoder_bound, generator))
                                       for layer in range(n)])
        self.b_dec = nn.Parameter(torch.zeros(n, d_out))
        if config.activation == "jumprelu":
            self.threshold = nn.Parameter(torch.full((n, m), THRESHOLD_INIT))
        if config.skip:
            self.W_skip = nn.Parameter(torch.zeros(n, d_out, d_in))

    @property
    def n_layers(self) -> int:
        return self.config.n_layers

    @property
    def d_in(self) -> int:
        return self.config.d_in

    @property
    def d_sae(self) -> int:
        return self.config.d_sae

    @property
    def d_out(self) -> int:
        return int(self.config.d_out or self.config.d_in)

    def _layer(self, layer: int) -> int:
        if not isinstance(layer, int) or not 0 <= layer < self.n_layers:
            raise DictionaryConfigError(f"CLT layer {layer!r} is outside 0..{self.n_layers - 1} (CLT layers count "
                                        f"from 0; config.layers maps them to model layers)")
        return layer

    def _input(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.d_in:
            raise DictionaryShapeError(f"CrossLayerTranscoder input has last dimension {x.shape[-1]}, but its d_in is "
                                       f"{self.d_in}; give it the activations of nodes of width {self.d_in}")
        return x.to(self.W_enc.dtype)

    def pre_activations(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """h_l = x W_enc[l] + b_enc[l]: ``[..., d_in]`` -> ``[..., m]``.

        Raises:
            DictionaryShapeError: ``x``'s last dimension is not ``d_in``.
            DictionaryConfigError: ``layer`` outside ``0..L−1``.
        """
        layer = self._layer(layer)
        return self._input(x) @ self.W_enc[layer] + self.b_enc[layer]

    def activate(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        """a_l = σ(h_l): ``[..., m]`` -> ``[..., m]`` (JumpReLU with layer ``layer``'s thresholds)."""
        config = self.config
        if config.activation == "relu":
            return h.relu()
        if config.activation == "topk":
            return activations.topk(h, int(config.k))  # type: ignore[arg-type]
        return activations.jumprelu(h, self.threshold[self._layer(layer)], config.bandwidth)

    def encode(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """Layer ``layer``'s latents a_l = σ(x W_enc[l] + b_enc[l]): ``[..., d_in]`` -> ``[..., m]``."""
        return self.activate(layer, self.pre_activations(layer, x))

    def decode(self, layer: int, latents: Sequence[torch.Tensor]) -> torch.Tensor:
        """Output layer l′ = ``layer`` without the skip term: Σ_{s ≤ l′} latents[s] W_dec[s][:, l′ − s] + b_dec[l′].

        Args:
            layer: l′.
            latents: a_s ``[..., m]`` for s = 0..l′ at least (later entries are not read), same leading sizes.

        Returns:
            ``[..., d_out]``; the terms are summed in layer order s = 0, 1, .., l′.

        Raises:
            DictionaryShapeError: fewer than l′ + 1 entries, or an entry not ``[..., m]``.
        """
        layer = self._layer(layer)
        if len(latents) <= layer:
            raise DictionaryShapeError(f"decoding CLT output layer {layer} needs the latents of layers 0..{layer}, got "
                                       f"{len(latents)} entries")
        value = self.b_dec[layer]
        for source in range(layer + 1):
            a = latents[source]
            if a.shape[-1] != self.d_sae:
                raise DictionaryShapeError(f"latents[{source}] has last dimension {a.shape[-1]}, but the CLT has "
                                           f"d_sae={self.d_sae} latents per layer")
            value = value + a.to(self.b_dec.dtype) @ self.W_dec[source][:, layer - source]
        return value

    def skip_term(self, layer: int, x: torch.Tensor) -> torch.Tensor | None:
        """x_l W_skip[l]ᵀ ``[..., d_out]`` with ``skip``, ``None`` without."""
        if not self.config.skip:
            return None
        return self._input(x) @ self.W_skip[self._layer(layer)].T

    def output(self, layer: int, x: torch.Tensor, latents: Sequence[torch.Tensor]) -> torch.Tensor:
        """ŷ_l′ for input ``x`` = x_l′ ``[..., d_in]`` and (possibly edited) ``latents`` of layers 0..l′:
        decode(l′, latents) + skip_term(l′, x), ``[..., d_out]``."""
        decoded = self.decode(layer, latents)
        skipped = self.skip_term(layer, x)
        return decoded if skipped is None else decoded + skipped

    def decoder_vectors(self, layer: int, features: torch.Tensor) -> torch.Tensor:
        """The decoders of latents ``features`` of layer ``layer``: ``W_dec[l][features]``, ``[k, L − l, d_out]``
        (entry ``[j, t]`` writes to output layer ``l + t``), as circuit-tracer's ``_get_decoder_vectors``.

        Args:
            layer: the CLT layer ``l``.
            features: latent indices ``[k]`` (a LongTensor) in ``0..m−1``.
        """
        return self.W_dec[self._layer(layer)][features]

    def forward(self, xs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """All ``L`` outputs ŷ_0..ŷ_{L−1} (``[..., d_out]`` each) from all ``L`` inputs ``xs`` (``[..., d_in]`` each).

        Raises:
            DictionaryShapeError: not ``L`` inputs, or an input of another width.
        """
        if len(xs) != self.n_layers:
            raise DictionaryShapeError(f"the CLT has {self.n_layers} layers but got {len(xs)} inputs; give one per "
                                       f"layer")
        latents = [self.encode(layer, x) for layer, x in enumerate(xs)]
        return [self.output(layer, xs[layer], latents) for layer in range(self.n_layers)]

    def extra_repr(self) -> str:
        config = self.config
        k = f", k={config.k}" if config.k is not None else ""
        skip = ", skip=True" if config.skip else ""
        return (f"n_layers={config.n_layers}, d_in={config.d_in}, d_sae={config.d_sae}, d_out={self.d_out}, "
                f"activation={config.activation}{k}{skip}")


def _uniform(shape: tuple[int, ...], bound: float, generator: torch.Generator | None) -> torch.Tensor:
    """U(−bound, bound) of ``shape``."""
    return (torch.rand(shape, generator=generator) * 2 - 1) * bound
