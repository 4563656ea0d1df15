"""Causal tracing: where in the network a model recalls a fact (Meng et al. 2022, arXiv 2202.05262, section 2).

The method (paper section 2.1, Figure 1):

1. **Clean run.** Run the prompt (e.g. "The Eiffel Tower is located in the city of") and record every hidden
   state, MLP output and attention output; the answer ``o`` is the first token of the clean greedy
   prediction (" Paris") unless one is given. ``P[o]`` is the *clean probability*.
2. **Corrupted run.** Add Gaussian noise ``ε ~ N(0, ν²)`` to the embeddings of the subject's tokens
   ("The Eiffel Tower"), with ``ν = noise_level × σ`` (``noise_level = 3`` as in the paper) and ``σ`` the
   standard deviation of the embeddings. ``P*[o]``, averaged over ``samples`` noise draws, is the
   *corrupted baseline*.
3. **Corrupted-with-restoration runs.** For every layer ``l`` and token ``i``, rerun the corrupted input but
   force one state back to its clean value: the hidden state after layer ``l`` at token ``i`` (kind
   ``"hidden"``), or the MLP outputs (``"mlp"``) or attention outputs (``"attn"``) at token ``i`` of the
   layers in a window centred on ``l``. ``P*_clean(h_i^l)[o]`` is the probability recovered by restoring that
   state; its excess over the corrupted baseline is the *indirect effect* of the state.

Everything is built from the patch engine: :class:`~gradpatch.ProbePatch` records the clean states,
:class:`~gradpatch.AddPatch` adds the noise at the embedding node and :class:`~gradpatch.ReplacePatch` writes
the clean states back. Restorations are batched: each forward pass holds many ``(layer, token, noise sample)``
rows, each row restoring its own ``(layer, token)`` through one advanced-index ``ReplacePatch`` per node.

Noise scale. ``σ`` defaults to the standard deviation of all entries of the input-embedding matrix. The paper's
code measures it instead over the embeddings of the subject tokens of its dataset of known facts;
:func:`corpus_embedding_std` measures it over any list of texts in the same way, and ``noise_std=`` takes either
number. Noise draws are sampled once (seeded) and reused for the corrupted baseline and for every restoration, as
in the paper's reference code, so all cells of the heatmap compare like with like.

One module per job:

- :mod:`.config`: :class:`TraceConfig` (samples, noise, seed, windows, batch size) and :data:`KINDS`; no torch,
  so the ``gradpatch trace`` command's ``--help`` reads its defaults cheaply;
- :mod:`.paths`: :class:`ModelPaths`, the NodePaths of a model family (:data:`LLAMA_PATHS`, :data:`GPT2_PATHS`),
  read from the one layout table :mod:`gradpatch.layouts`;
- :mod:`.noise`: the noise scale σ; :mod:`.trace`: :func:`causal_trace`; :mod:`.result`: :class:`TraceResult`;
- :mod:`.plot`: heatmaps; :mod:`.files`: :func:`save_trace`. TensorBoard images: :mod:`recipes.trace_tensorboard`.

Example::

    from gradpatch import PatchableGraph
    from editors.causal_trace import causal_trace, save_trace

    pg = PatchableGraph(model, ids.expand(2, -1), use_cache=False)   # a batch-2 example: no re-extraction
    result = causal_trace(pg, tokenizer, "{} is located in the city of", "The Eiffel Tower", samples=10)
    save_trace(result, "runs/trace")            # trace.json + trace_hidden.png, trace_mlp.png, trace_attn.png

Names are imported on first use (:func:`editors.lazy.lazy_exports`).
"""

from __future__ import annotations

from ..lazy import lazy_exports

#: Public name -> submodule that defines it.
_EXPORTS: dict[str, str] = {
    "DEFAULT_WINDOWS": "config",
    "KINDS": "config",
    "TraceConfig": "config",
    "GPT2_PATHS": "paths",
    "LLAMA_PATHS": "paths",
    "ModelPaths": "paths",
    "detect_model_paths": "paths",
    "layer_window": "paths",
    "corpus_embedding_std": "noise",
    "embedding_matrix_std": "noise",
    "KindTrace": "result",
    "TraceResult": "result",
    "causal_trace": "trace",
    "plot_trace": "plot",
    "save_trace": "files",
    "TraceError": ".errors",
    "TraceLayoutError": ".errors",
    "subject_token_range": ".passes.tokens",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
