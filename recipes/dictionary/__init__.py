"""Training sparse dictionaries (:mod:`gradpatch.dictionaries`) in Lightning on a frozen PatchableGraph's activations.

- :class:`DictionaryModule`: local losses on activations streamed through a bounded shuffle buffer.
- :class:`EndToEndDictionaryModule`: KL between the model and the model with the dictionary spliced, plus the
  downstream MSEs of "e2e+ds" (Braun et al.); :func:`downstream_residual_nodes`: their downstream nodes.
- :func:`splice_all`, :func:`spliced_ce_increase`, :func:`next_token_ce`: several dictionaries spliced at once and
  the CE they lose.
- :class:`ActivationBuffer`: that buffer; :class:`StreamingModule`: the base of the local trainings (the buffer, the
  decoder bias's data initialisation, the learning-rate schedule; :mod:`recipes.dictionary.settings`).
- :class:`CrossLayerTranscoderModule`: a cross-layer transcoder trained at every layer from one forward pass
  (Ameisen et al. 2025's loss); :class:`CLTFitModule`, :class:`CLTSpec`: from a ``clt:`` config
  (``recipes/configs/clt_smollm2.yaml``).
- :class:`DictionaryFitModule`, :class:`EndToEndDictionaryFitModule`, :class:`DictionaryDataModule`,
  :class:`DictionarySpec`: what ``gradpatch fit`` builds from a dictionary config (``recipes/configs/sae_smollm2.yaml``,
  ``sae_smollm2_e2e.yaml``).
- :func:`read_documents`, :func:`tokenize_documents`, :func:`packed_chunks`: a ``.txt`` / ``.jsonl`` / Wikipedia
  corpus as token ids; :func:`write_dictionary_metrics`, :func:`write_layer_metrics` (several layers, each spliced
  alone and all at once): ``metrics.json``.

See docs/dictionaries.md. Names are imported on first use, so ``import recipes.dictionary`` imports neither torch
nor Lightning.
"""

from __future__ import annotations

from ..lazy import recipe_exports

#: Public name -> submodule that defines it.
_EXPORTS: dict[str, str] = {
    "AUXK_COEFFICIENT": "module",
    "AuxKNormalization": "module",
    "BDecInit": "streaming",
    "ActivationBuffer": "buffer",
    "CLTFitModule": "cross_layer",
    "CLTSpec": "cross_layer",
    "CrossLayerTranscoderModule": "cross_layer",
    "SkipInit": "module",
    "StreamingModule": "streaming",
    "build_clt": "cross_layer",
    "expand_spec": "fit",
    "geometric_median": "settings",
    "least_squares_skip": "settings",
    "lr_factor": "settings",
    "warmup_factor": "settings",
    "write_layer_metrics": "metrics",
    "DictionaryDataModule": "fit",
    "DictionaryFitModule": "fit",
    "DictionaryModule": "module",
    "DictionarySpec": "fit",
    "EndToEndDictionaryFitModule": "fit",
    "EndToEndDictionaryModule": "end_to_end",
    "build_dictionaries": "fit",
    "build_dictionary": "fit",
    "downstream_residual_nodes": "end_to_end",
    "next_token_ce": "spliced",
    "splice_all": "spliced",
    "spliced_ce_increase": "spliced",
    "packed_chunks": "corpus",
    "read_documents": "corpus",
    "tokenize_documents": "corpus",
    "write_dictionary_metrics": "metrics",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = recipe_exports(__name__, _EXPORTS)
