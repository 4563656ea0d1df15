"""editors: model-editing algorithms on top of the gradpatch patch engine.

ROME (Meng et al. 2022, arXiv 2202.05262) at any linear layer chosen by NodePath, and many facts at once at several
layers with MEMIT (arXiv 2210.07229) and AlphaEdit (arXiv 2410.02355)::

    from gradpatch import PatchableGraph
    from editors import ROME, EditRequest

    pg = PatchableGraph(model, example_ids, use_cache=False)
    rome = ROME(pg, tokenizer, "model.layers_3.mlp.down_proj")
    edit = rome.edit(EditRequest(prompt="The capital of {} is", subject="France", target_new="London"))
    edit.save("edits/france")        # safetensors + JSON
    edit.restore(pg)                 # bit-identical original weights

    memit = MEMIT(pg, tokenizer, [f"model.layers_{i}.mlp.down_proj" for i in range(2, 7)])
    batch = memit.edit(requests)     # a BatchEdit: one low-rank edit per layer
    batch.restore(pg)

The algorithms' front doors are the modules at the top (:mod:`.rome`, :mod:`.memit`, :mod:`.alphaedit`); their parts
live in sub-packages by concern: :mod:`.edits` (edit objects, files), :mod:`.statistics` (second moment, corpus,
keys), :mod:`.value` (the value search), :mod:`.solve` (the closed forms), :mod:`.passes` (forward passes, tokens,
scores), :mod:`.evaluation` (CounterFact) and :mod:`.causal_trace`. See docs/architecture.md, docs/rome.md and
docs/memit.md.

Names are imported on first use (:func:`editors.lazy.lazy_exports`), so ``import editors`` does not import torch.
The internal algebra (``solve_second_moment``, ``update_direction``, ``BatchValueObjective``, ...) is reached from its
sub-package.
"""

from __future__ import annotations

from .lazy import lazy_exports

#: Public name -> submodule that defines it.
_EXPORTS: dict[str, str] = {
    "AlphaEdit": "alphaedit",
    "AlphaEditConfig": "alphaedit",
    "MEMITConfig": "config",
    "ROMEConfig": "config",
    "DEFAULT_MAX_LENGTH": "defaults",
    "DEFAULT_N_SAMPLES": "defaults",
    "DEFAULT_MOM2_RELATIVE_WEIGHT": "defaults",
    "DEFAULT_SMOLLM2_NODE": "defaults",
    "DEFAULT_SMOLLM2_NODES": "defaults",
    "METHODS": "defaults",
    "BatchEdit": "edits.batch",
    "Editor": "editor",
    "Edit": "edits.edit",
    "apply_edits": "edits.edit",
    "load_edits": "edits.edit",
    "restore_edits": "edits.edit",
    "save_edits": "edits.edit",
    "ConflictingRequestsError": "errors",
    "EditError": "errors",
    "EditFingerprintError": "errors",
    "EditLoadError": "errors",
    "EditNotConvergedError": "errors",
    "LayerKindError": "errors",
    "StatisticsError": "errors",
    "SubjectNotFoundError": "errors",
    "TokenizationError": "errors",
    "TraceError": "errors",
    "CounterFactCase": "evaluation.counterfact",
    "load_cases": "evaluation.counterfact",
    "save_cases": "evaluation.counterfact",
    "evaluate_cases": "evaluation.sequential",
    "score_case": "evaluation.scores",
    "evaluate_sequential": "evaluation.sequential",
    "ExpertLayer": "layers",
    "top_expert": "layers",
    "LinearLayer": "layers",
    "editable_graph": "layers",
    "resolve_layer": "layers",
    "MEMIT": "memit",
    "config_for": "methods",
    "editor_for": "methods",
    "lazy_exports": "lazy",
    "EditRequest": "requests",
    "ROME": "rome",
    "Corpus": "statistics.corpus",
    "open_corpus": "statistics.corpus",
    "wiki_summaries": "statistics.corpus",
    "wiki_summaries_path": "statistics.corpus",
    "ContextPrefixes": "statistics.keys",
    "compute_key": "statistics.keys",
    "context_activations": "statistics.keys",
    "generate_context_prefixes": "statistics.keys",
    "SecondMoment": "statistics.second_moment",
    "compute_second_moment": "statistics.second_moment",
    "compute_second_moments": "statistics.second_moment",
    "default_cache_dir": "statistics.second_moment",
    "layer_second_moment": "statistics.second_moment",
    "layer_second_moments": "statistics.second_moment",
    "statistics_fingerprint": "statistics.second_moment",
    "ValueObjective": "value.search",
    "ValueResult": "value.loop",
    "ValueRunner": "value.search",
    "optimize_value": "value.search",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
