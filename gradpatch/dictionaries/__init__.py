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
from .errors import DictionaryConfigError, DictionaryError, DictionaryLoadError, DictionaryShapeError
from .evaluation import SAELENS_NAMES, DictionaryMetrics, evaluate_dictionary
from .losses import auxk_loss, jumprelu_l0, l1_penalty, normalized_mse, remove_parallel_gradient, unit_norm_rows
from .modules import DictionaryConfig, SkipTranscoder, SparseAutoencoder, SparseDictionary, Transcoder
from .saelens_format import export_saelens, load_saelens
from .sparsify_format import load_sparsify
from .splice import DictionaryPatch, Splice, TranscoderInput, splice, trained_positions
from .storage import load_dictionary, save_dictionary

__all__ = [
    "ACTIVATIONS",
    "DictionaryConfig",
    "DictionaryConfigError",
    "DictionaryError",
    "DictionaryLoadError",
    "DictionaryMetrics",
    "DictionaryPatch",
    "DictionaryShapeError",
    "SAELENS_NAMES",
    "SkipTranscoder",
    "SparseAutoencoder",
    "SparseDictionary",
    "Splice",
    "Transcoder",
    "TranscoderInput",
    "auxk_loss",
    "batch_topk",
    "evaluate_dictionary",
    "export_circuit_tracer",
    "export_saelens",
    "jumprelu",
    "jumprelu_l0",
    "l1_penalty",
    "load_circuit_tracer",
    "load_dictionary",
    "load_saelens",
    "load_sparsify",
    "normalized_mse",
    "rectangle",
    "remove_parallel_gradient",
    "save_dictionary",
    "splice",
    "trained_positions",
    "step",
    "topk",
    "unit_norm_rows",
]
