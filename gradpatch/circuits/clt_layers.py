"""One layer of a cross-layer transcoder (CLT) seen as the replacement model's per-layer transcoder.

The local replacement model (:mod:`gradpatch.circuits.replacement`) keeps one
:class:`~gradpatch.circuits.replacement.SplicedLayer` per spliced MLP, whose ``transcoder`` is read for its encoder
(``W_enc``, ``pre_activations``: feature targets), its skip term (the replay) and its decoders (feature sources). A
CLT layer l (model layer ``config.layers[l]``) encodes like a transcoder, h_l = x_l W_enc[l] + b_enc[l], but its
latents write to every output layer l′ ≥ l through W_dec[l][:, l′ − l] (Ameisen et al. 2025, "Circuit Tracing",
section 2.1; circuit-tracer's ``CrossLayerTranscoder``): :meth:`CLTLayerView.decoder_blocks` lists those blocks,
which :func:`gradpatch.circuits.complete.decoder_blocks` returns for the edges, the completeness biases, the
source perturbations and the feature annotations.
"""

from __future__ import annotations

import torch
from torch import nn

from ..dictionaries.clt import CrossLayerTranscoder

__all__ = ["CLTLayerConfig", "CLTLayerView", "clt_layer_views"]


class CLTLayerConfig:
    """What the circuits code reads of a transcoder's config, for one CLT layer.

    Attributes:
        kind: ``"transcoder"`` (a CLT layer reads and writes different nodes, as a transcoder does).
        input_node, output_node: the NodePaths the CLT layer reads and writes.
        model_fingerprint: the CLT's, if recorded.
        layer: the model layer (``CLTConfig.layers[index]``).
    """

    kind = "transcoder"

    def __init__(self, input_node: str, output_node: str, model_fingerprint: str | None, layer: int) -> None:
        self.input_node, self.output_node = input_node, output_node
        self.model_fingerprint, self.layer = model_fingerprint, layer


class CLTLayerView(nn.Module):
    """CLT layer ``index`` as a transcoder of the replacement model (module docstring); the CLT's parameters are
    shared, not copied.

    Args:
        clt: the cross-layer transcoder.
        index: the CLT layer l in ``0..L−1``.
        input_node, output_node: the NodePaths layer l reads and writes.
    """

    def __init__(self, clt: CrossLayerTranscoder, index: int, input_node: str, output_node: str) -> None:
        super().__init__()
        self.clt = clt
        self.index = index
        layers = list(clt.config.layers or range(clt.n_layers))
        self.config = CLTLayerConfig(input_node, output_node, clt.config.model_fingerprint, layers[index])
        #: the model layer of each output layer l′ ≥ l that this layer's latents write.
        self.written_layers = layers[index:]

    @property
    def d_in(self) -> int:
        return self.clt.d_in

    @property
    def d_out(self) -> int:
        return self.clt.d_out

    @property
    def d_sae(self) -> int:
        return self.clt.d_sae

    @property
    def W_enc(self) -> torch.Tensor:  # noqa: N802
        """The encoder of layer l ``[d_in, m]``."""
        return self.clt.W_enc[self.index]

    def pre_activations(self, x: torch.Tensor) -> torch.Tensor:
        """h_l = x W_enc[l] + b_enc[l]: ``[..., d_in]`` -> ``[..., m]``."""
        return self.clt.pre_activations(self.index, x)

    def skip(self, x: torch.Tensor) -> torch.Tensor | None:
        """x_l W_skip[l]ᵀ ``[..., d_out]`` for a CLT with skip terms, ``None`` without."""
        return self.clt.skip_term(self.index, x)

    def decoder_blocks(self) -> list[tuple[int, torch.Tensor]]:
        """(model layer of output layer l′, W_dec[l][:, l′ − l] ``[m, d_out]``, detached) for every l′ ≥ l."""
        decoder = self.clt.W_dec[self.index].detach()
        return [(layer, decoder[:, offset]) for offset, layer in enumerate(self.written_layers)]


def clt_layer_views(clt: CrossLayerTranscoder, input_nodes: list[str],
                    output_nodes: list[str]) -> dict[int, CLTLayerView]:
    """model layer -> :class:`CLTLayerView` of each CLT layer, reading ``input_nodes[l]`` and writing
    ``output_nodes[l]``."""
    views = [CLTLayerView(clt, index, input_nodes[index], output_nodes[index]) for index in range(clt.n_layers)]
    return {view.config.layer: view for view in views}
