"""What the closed forms need from the model before any value search: the second moment ``C = E[k kᵀ]`` of the
edited layer's inputs over a text corpus (streamed, cached on disk), the corpus itself, and the keys ``k*`` at the
subject's last token averaged over sampled context prefixes (Meng et al. 2022, section 3.1).

Names are imported on first use (:func:`editors.lazy.lazy_exports`).
"""

from __future__ import annotations

from ..lazy import lazy_exports

#: Public name -> submodule that defines it.
_EXPORTS: dict[str, str] = {
    "Corpus": "corpus",
    "open_corpus": "corpus",
    "wiki_summaries": "corpus",
    "wiki_summaries_path": "corpus",
    "ContextPrefixes": "keys",
    "compute_key": "keys",
    "context_activations": "keys",
    "generate_context_prefixes": "keys",
    "load_or_generate_prefixes": "keys",
    "SecondMoment": "second_moment",
    "SecondMomentSums": "second_moment",
    "save_second_moment": "second_moment",
    "second_moment_cache_file": "second_moment",
    "compute_second_moment": "second_moment",
    "compute_second_moments": "second_moment",
    "default_cache_dir": "second_moment",
    "layer_second_moment": "second_moment",
    "layer_second_moments": "second_moment",
    "statistics_fingerprint": "second_moment",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
