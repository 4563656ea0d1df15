"""Sparse dictionaries on the op graph: sparse autoencoders, transcoders and skip transcoders as ``nn.Module``s,
their local losses, their files (ours, SAELens's, sparsify's, circuit-tracer's) and their splicing as patches.

Example::

    from gradpatch.dictionaries import SparseAutoencoder, splice
    sae = SparseAutoencoder(d_in=576, d_sae=2304, activation="topk", k=32)
    with pg.patch(s := splice(pg, sae, "model.layers_12.output")):   # exact: the error term is kept
        pg(ids)
    s.latents                                                          # [batch, seq, 2304]

See docs/dictionaries.md.
"""

from .activations import ACTIVATIONS, batch_topk, jumprelu, rectangle, step, topk
from .circuit_tracer_format import export_circuit_tracer, load_circuit_tracer
from .clt import CLTConfig, CrossLayerTranscoder
from .clt_circuit_tracer import export_circuit_tracer_clt, load_circuit_tracer_clt
from .clt_files import load_clt, save_clt
from .clt_splice import CLTOutputPatch, CLTSplice, splice_clt
from .errors import DictionaryConfigError, DictionaryError, DictionaryLoadError, DictionaryShapeError
from .evaluation import SAELENS_NAMES, DictionaryMetrics, evaluate_dictionary
from .layers_evaluation import (AllSplicedMetrics, DictionaryLayers, LayerMetrics, cross_layer_layers, evaluate_layers,
                                per_layer_dictionaries, splice_layers)
from .losses import (auxk_loss, cross_layer_auxk_loss, jumprelu_l0, l1_penalty, normalized_mse, pre_activation_loss,
                     remove_parallel_gradient, sparse_decode, tanh_penalty, unit_norm_rows)
from .modules import DictionaryConfig, SkipTranscoder, SparseAutoencoder, SparseDictionary, Transcoder
from .saelens_format import export_saelens, load_saelens
from .sparsify_format import load_sparsify
from .splice import DictionaryPatch, Splice, TranscoderInput, splice, trained_positions
from .storage import load_dictionary, save_dictionary
from .top_activations import Snippet, top_activating_snippets

__all__ = [
    "ACTIVATIONS",
    "AllSplicedMetrics",
    "CLTConfig",
    "CLTOutputPatch",
    "CLTSplice",
    "CrossLayerTranscoder",
    "DictionaryConfig",
    "DictionaryConfigError",
    "DictionaryError",
    "DictionaryLayers",
    "DictionaryLoadError",
    "DictionaryMetrics",
    "DictionaryPatch",
    "DictionaryShapeError",
    "LayerMetrics",
    "SAELENS_NAMES",
    "SkipTranscoder",
    "Snippet",
    "SparseAutoencoder",
    "SparseDictionary",
    "Splice",
    "Transcoder",
    "TranscoderInput",
    "auxk_loss",
    "batch_topk",
    "cross_layer_auxk_loss",
    "cross_layer_layers",
    "evaluate_dictionary",
    "evaluate_layers",
    "export_circuit_tracer",
    "export_circuit_tracer_clt",
    "export_saelens",
    "jumprelu",
    "jumprelu_l0",
    "l1_penalty",
    "load_circuit_tracer",
    "load_circuit_tracer_clt",
    "load_clt",
    "load_dictionary",
    "load_saelens",
    "load_sparsify",
    "normalized_mse",
    "per_layer_dictionaries",
    "pre_activation_loss",
    "rectangle",
    "remove_parallel_gradient",
    "save_clt",
    "save_dictionary",
    "splice",
    "splice_clt",
    "splice_layers",
    "sparse_decode",
    "trained_positions",
    "step",
    "tanh_penalty",
    "top_activating_snippets",
    "topk",
    "unit_norm_rows",
]
