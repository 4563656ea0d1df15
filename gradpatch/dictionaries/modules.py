"""Sparse dictionaries as ``nn.Module``s: sparse autoencoders, transcoders and skip transcoders.

One computation covers the three kinds (shapes: ``x`` ``[..., d_in]``, latents ``z`` ``[..., m]`` with ``m = d_sae``,
output ``[..., d_out]``)::

    h  = (x − b_dec · [apply_b_dec_to_input]) W_enc + b_enc       W_enc [d_in, m], b_enc [m]
    z  = σ(h)                                                     σ: ReLU, TopK, BatchTopK or JumpReLU_θ
    x̂  = z W_dec + b_dec  (+ x W_skipᵀ for a skip transcoder)     W_dec [m, d_out], b_dec [d_out], W_skip [d_out, d_in]

- :class:`SparseAutoencoder`: ``d_out = d_in``, reconstructs its own node; with ``apply_b_dec_to_input`` (the
  default) the decoder bias is subtracted before encoding (b_pre = b_dec, Gao et al. 2024, arXiv 2406.04093, eq. 1).
- :class:`Transcoder`: reads one node (``d_in``) and predicts another (``d_out``), e.g. an MLP's input and output
  (Dunefsky et al. 2024, "Transcoders find interpretable LLM feature circuits", arXiv 2406.11944).
- :class:`SkipTranscoder`: a transcoder plus the linear skip term ``x W_skipᵀ`` (Paulo et al. 2025, "Transcoders
  beat sparse autoencoders for interpretability", arXiv 2501.18823).

Parameter names and orientations are SAELens's (``W_enc`` ``[d_in, d_sae]``, ``W_dec`` ``[d_sae, d_out]``), so a
decoder row ``W_dec[i]`` is feature ``i``'s direction in the output space.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import torch
from torch import nn

from . import activations
from .errors import DictionaryConfigError, DictionaryShapeError

__all__ = ["DICTIONARY_KINDS", "DictionaryConfig", "Kind", "SkipTranscoder", "SparseAutoencoder", "SparseDictionary",
           "Transcoder"]

Kind = Literal["sae", "transcoder", "skip_transcoder"]
#: A dataclass config (:class:`DictionaryConfig`, :class:`~gradpatch.dictionaries.CLTConfig`).
ConfigT = TypeVar("ConfigT")
#: The initial JumpReLU threshold θ of every latent (Rajamanoharan et al. 2024, section 5).
THRESHOLD_INIT = 0.001


@dataclass
class DictionaryConfig:
    """What a dictionary is (saved as JSON beside its tensors).

    Attributes:
        kind: ``"sae"``, ``"transcoder"`` or ``"skip_transcoder"``.
        activation: ``"relu"``, ``"topk"``, ``"batchtopk"`` or ``"jumprelu"``.
        d_in: the width of the node read.
        d_sae: ``m``, the number of latents.
        d_out: the width of the node written (``d_in`` for an SAE; ``None`` means ``d_in``).
        k: active latents per token (TopK, BatchTopK), ``None`` otherwise.
        bandwidth: ε of JumpReLU's straight-through estimator.
        apply_b_dec_to_input: subtract ``b_dec`` before encoding (SAEs only). ``None`` (the default) resolves to
            the kind's one default: ``True`` for an SAE (Gao et al.'s b_pre = b_dec, as sparsify and SAELens default
            to), ``False`` for a transcoder (whose ``b_dec`` lives in the output space). Every ``dictionary.json``
            :func:`~gradpatch.dictionaries.save_dictionary` writes holds the resolved value, so saved files load as
            they were saved.
        input_node: the NodePath read, if known.
        output_node: the NodePath written (an SAE's is its ``input_node``), if known.
        model_fingerprint: :func:`gradpatch.model_fingerprint` of the model it was trained on, if known.
        exclude_first_positions: the first positions of every sequence that training leaves out and
            :func:`~gradpatch.dictionaries.evaluate_dictionary` leaves as the model computes them (not spliced, not
            scored in FVU): attention sinks. SmolLM2 has no BOS and its residual stream at position 0 (sometimes 1 too)
            has a norm ~150× the other tokens' (89 % of the variance after layer 12 on packed chunks), which a
            dictionary trained on every position spends itself on; SAELens leaves out special tokens and circuit-tracer
            position 0 for the same reason. :func:`~gradpatch.dictionaries.trained_positions` gives the matching
            splice ``slice``. 0 (default): every position.
    """

    kind: Kind
    activation: str
    d_in: int
    d_sae: int
    d_out: int | None = None
    k: int | None = None
    bandwidth: float = 0.001
    apply_b_dec_to_input: bool | None = None
    input_node: str | None = None
    output_node: str | None = None
    model_fingerprint: str | None = None
    exclude_first_positions: int = 0

    def __post_init__(self) -> None:
        if self.d_out is None:
            self.d_out = self.d_in
        if self.kind == "sae" and self.output_node is None:
            self.output_node = self.input_node
        if self.apply_b_dec_to_input is None:
            self.apply_b_dec_to_input = self.kind == "sae"
        self.validate()

    def validate(self) -> None:
        """Raise :class:`DictionaryConfigError` (naming the fix) unless the fields describe a dictionary."""
        if self.kind not in DICTIONARY_KINDS:
            raise DictionaryConfigError(f"dictionary kind {self.kind!r} is not one of {sorted(DICTIONARY_KINDS)}")
        if self.activation not in activations.ACTIVATIONS:
            raise DictionaryConfigError(f"activation {self.activation!r} is not one of {activations.ACTIVATIONS}")
        for name in ("d_in", "d_sae", "d_out"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise DictionaryConfigError(f"{name} must be a positive int, got {value!r}")
        if self.activation in ("topk", "batchtopk"):
            if not isinstance(self.k, int) or not 1 <= self.k <= self.d_sae:
                raise DictionaryConfigError(f"{self.activation} needs k in 1..d_sae={self.d_sae}, got k={self.k!r}")
        elif self.k is not None:
            raise DictionaryConfigError(f"k={self.k} applies to topk and batchtopk only, not {self.activation}; "
                                        f"leave k=None")
        if not isinstance(self.exclude_first_positions, int) or self.exclude_first_positions < 0:
            raise DictionaryConfigError(f"exclude_first_positions must be an int >= 0, got "
                                        f"{self.exclude_first_positions!r}")
        if not self.bandwidth > 0:
            raise DictionaryConfigError(f"bandwidth must be > 0, got {self.bandwidth!r}")
        if self.kind == "sae" and self.d_out != self.d_in:
            raise DictionaryConfigError(f"a sparse autoencoder reconstructs its input: d_out={self.d_out} must equal "
                                        f"d_in={self.d_in} (use a Transcoder to predict another width)")
        if self.kind != "sae" and self.apply_b_dec_to_input:
            raise DictionaryConfigError("a transcoder's b_dec lives in the output space; apply_b_dec_to_input must be "
                                        "False")

    def to_dict(self) -> dict[str, Any]:
        """The fields as a JSON-ready dict."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, fields: dict[str, Any]) -> "DictionaryConfig":
        """The config of ``fields`` (unknown keys rejected).

        Raises:
            DictionaryConfigError: unknown or missing fields, or invalid values.
        """
        return config_from_dict(cls, fields, "dictionary")


def config_from_dict(cls: type[ConfigT], fields: dict[str, Any], what: str) -> ConfigT:
    """The dataclass config ``cls`` of ``fields`` (unknown keys rejected); ``what`` names it in errors.

    Raises:
        DictionaryConfigError: unknown or missing fields, or invalid values (the class's own checks).
    """
    known = {field.name for field in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(fields) - known)
    if unknown:
        raise DictionaryConfigError(f"unknown {what} config fields {unknown}; known: {sorted(known)}")
    try:
        return cls(**fields)
    except TypeError as error:
        raise DictionaryConfigError(f"incomplete {what} config {fields}: {error}") from error


class SparseDictionary(nn.Module):
    """Base class of the three kinds: ``encode``, ``decode`` and ``forward`` as in the module docstring.

    Args:
        config: the dictionary (kind, activation, widths).
        generator: random generator of the initial weights (unit-norm decoder rows; an SAE's encoder is the
            decoder's transpose, Gao et al. section 2.2; a transcoder's has unit-norm columns; biases 0, W_skip 0,
            JumpReLU θ = 0.001).

    Attributes:
        W_enc, b_enc, W_dec, b_dec: parameters (shapes above); ``threshold`` ``[m]`` (JumpReLU), ``W_skip``
            ``[d_out, d_in]`` (skip transcoders), buffer ``batch_threshold`` (scalar, BatchTopK: θ of evaluation).
    """

    def __init__(self, config: DictionaryConfig, generator: torch.Generator | None = None) -> None:
        super().__init__()
        config.validate()
        self.config = config
        d_in, m, d_out = config.d_in, config.d_sae, int(config.d_out or config.d_in)
        decoder = _unit_rows(torch.randn(m, d_out, generator=generator))
        encoder = decoder.T.clone() if config.kind == "sae" else _unit_rows(torch.randn(m, d_in, generator=generator)).T
        self.W_enc = nn.Parameter(encoder.contiguous())
        self.b_enc = nn.Parameter(torch.zeros(m))
        self.W_dec = nn.Parameter(decoder)
        self.b_dec = nn.Parameter(torch.zeros(d_out))
        if config.activation == "jumprelu":
            self.threshold = nn.Parameter(torch.full((m,), THRESHOLD_INIT))
        if config.activation == "batchtopk":
            self.register_buffer("batch_threshold", torch.zeros(()))
        if config.kind == "skip_transcoder":
            self.W_skip = nn.Parameter(torch.zeros(d_out, d_in))

    @classmethod
    def from_config(cls, config: DictionaryConfig) -> "SparseDictionary":
        """A freshly initialised dictionary of ``config``'s kind (:class:`SparseAutoencoder`, ...)."""
        dictionary = nn.Module.__new__(DICTIONARY_KINDS[config.kind])
        SparseDictionary.__init__(dictionary, config)
        return dictionary

    @property
    def d_in(self) -> int:
        return self.config.d_in

    @property
    def d_sae(self) -> int:
        return self.config.d_sae

    @property
    def d_out(self) -> int:
        return int(self.config.d_out or self.config.d_in)

    def _check(self, x: torch.Tensor, width: int, what: str) -> torch.Tensor:
        if x.shape[-1] != width:
            raise DictionaryShapeError(f"{type(self).__name__} {what} has last dimension {x.shape[-1]}, but the "
                                       f"dictionary's width there is {width}; splice it at a node of that width")
        return x.to(self.W_enc.dtype)

    def pre_activations(self, x: torch.Tensor) -> torch.Tensor:
        """h = (x − b_dec·[apply_b_dec_to_input]) W_enc + b_enc: ``[..., d_in]`` -> ``[..., m]``.

        Raises:
            DictionaryShapeError: ``x``'s last dimension is not ``d_in``.
        """
        x = self._check(x, self.d_in, "input")
        if self.config.apply_b_dec_to_input:
            x = x - self.b_dec
        return x @ self.W_enc + self.b_enc

    def activate(self, h: torch.Tensor) -> torch.Tensor:
        """z = σ(h): ``[..., m]`` -> ``[..., m]`` (BatchTopK updates its evaluation threshold in training mode:
        θ ← 0.99 θ + 0.01 · smallest kept value, as SAELens does)."""
        config = self.config
        if config.activation == "relu":
            return h.relu()
        if config.activation == "topk":
            return activations.topk(h, int(config.k))  # type: ignore[arg-type]
        if config.activation == "jumprelu":
            return activations.jumprelu(h, self.threshold, config.bandwidth)
        if not self.training:
            return activations.jumprelu(h, self.batch_threshold, config.bandwidth)
        z, smallest = activations.batch_topk(h, int(config.k))  # type: ignore[arg-type]
        with torch.no_grad():
            self.batch_threshold.mul_(0.99).add_(0.01 * smallest.to(self.batch_threshold.dtype))
        return z

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Latents z = σ(h(x)): ``[..., d_in]`` -> ``[..., m]``."""
        return self.activate(self.pre_activations(x))

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        """z W_dec + b_dec: ``[..., m]`` -> ``[..., d_out]`` (without a skip transcoder's skip term)."""
        return z.to(self.W_dec.dtype) @ self.W_dec + self.b_dec

    def skip(self, x: torch.Tensor) -> torch.Tensor | None:
        """x W_skipᵀ ``[..., d_out]`` for a skip transcoder, ``None`` for the other kinds."""
        if self.config.kind != "skip_transcoder":
            return None
        return self._check(x, self.d_in, "input") @ self.W_skip.T

    def output(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """The dictionary's output for input ``x`` and (possibly edited) latents ``z``: decode(z) + skip(x)."""
        decoded = self.decode(z)
        skipped = self.skip(x)
        return decoded if skipped is None else decoded + skipped

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x̂ = decode(encode(x)) (+ x W_skipᵀ): ``[..., d_in]`` -> ``[..., d_out]``."""
        return self.output(x, self.encode(x))

    def extra_repr(self) -> str:
        config = self.config
        k = f", k={config.k}" if config.k is not None else ""
        return f"d_in={config.d_in}, d_sae={config.d_sae}, d_out={self.d_out}, activation={config.activation}{k}"


class SparseAutoencoder(SparseDictionary):
    """A sparse autoencoder at one node: ``[..., d]`` -> latents ``[..., m]`` -> ``[..., d]`` (module docstring).

    Args:
        d_in: the node's width ``d``.
        d_sae: ``m``.
        activation: ``"topk"`` (default), ``"batchtopk"``, ``"jumprelu"`` or ``"relu"`` (train with an L1 penalty).
        k: active latents per token for TopK / BatchTopK.
        node: the NodePath it reads and reconstructs, if known.
        apply_b_dec_to_input: subtract ``b_dec`` before encoding (Gao et al.'s b_pre); ``None`` (default): the
            config's default for an SAE, ``True``.
        bandwidth: JumpReLU's ε.
        exclude_first_positions: positions left out of training and evaluation (:class:`DictionaryConfig`).
        generator: random generator of the initial weights.

    Raises:
        DictionaryConfigError: an invalid combination (the message names the fix).
    """

    def __init__(self, d_in: int, d_sae: int, activation: str = "topk", k: int | None = None, *,
                 node: str | None = None, apply_b_dec_to_input: bool | None = None, bandwidth: float = 0.001,
                 exclude_first_positions: int = 0, generator: torch.Generator | None = None) -> None:
        super().__init__(DictionaryConfig("sae", activation, d_in, d_sae, k=k, bandwidth=bandwidth,
                                          apply_b_dec_to_input=apply_b_dec_to_input, input_node=node,
                                          exclude_first_positions=exclude_first_positions), generator)


class Transcoder(SparseDictionary):
    """Reads node A (``[..., d_in]``) and predicts node B (``[..., d_out]``) through ``m`` sparse latents.

    Args:
        d_in, d_sae, d_out: widths (``d_out`` defaults to ``d_in``).
        activation, k, bandwidth, exclude_first_positions, generator: as :class:`SparseAutoencoder`.
        input_node, output_node: the NodePaths read and predicted, if known (e.g. an MLP's input and output).

    Raises:
        DictionaryConfigError: an invalid combination.
    """

    kind: Kind = "transcoder"

    def __init__(self, d_in: int, d_sae: int, d_out: int | None = None, activation: str = "topk",
                 k: int | None = None, *, input_node: str | None = None, output_node: str | None = None,
                 bandwidth: float = 0.001, exclude_first_positions: int = 0,
                 generator: torch.Generator | None = None) -> None:
        super().__init__(DictionaryConfig(self.kind, activation, d_in, d_sae, d_out, k=k, bandwidth=bandwidth,
                                          input_node=input_node, output_node=output_node,
                                          exclude_first_positions=exclude_first_positions), generator)


class SkipTranscoder(Transcoder):
    """A :class:`Transcoder` plus a linear skip term: x̂ = z W_dec + b_dec + x W_skipᵀ, W_skip ``[d_out, d_in]``
    initialised at 0 (Paulo et al. 2025, arXiv 2501.18823, section 2). Same arguments as :class:`Transcoder`."""

    kind: Kind = "skip_transcoder"


def _unit_rows(matrix: torch.Tensor) -> torch.Tensor:
    return matrix / matrix.norm(dim=-1, keepdim=True).clamp_min(1e-12)


#: Saved kind -> class.
DICTIONARY_KINDS: dict[str, type[SparseDictionary]] = {
    "sae": SparseAutoencoder, "transcoder": Transcoder, "skip_transcoder": SkipTranscoder}
