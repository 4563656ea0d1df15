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

See docs/rome.md and docs/memit.md. Names are imported on first use (:func:`editors.lazy.lazy_exports`), so
``import editors`` does not import torch.
"""

from __future__ import annotations

from .lazy import lazy_exports

#: Public name -> submodule that defines it.
_EXPORTS: dict[str, str] = {
    "AlphaEdit": "alphaedit",
    "AlphaEditConfig": "alphaedit",
    "BatchValueObjective": "batch_value",
    "optimize_values": "batch_search",
    "Corpus": "corpus",
    "open_corpus": "corpus",
    "wiki_summaries": "corpus",
    "wiki_summaries_path": "corpus",
    "CounterFactCase": "counterfact",
    "EditRequest": "counterfact",
    "load_cases": "counterfact",
    "save_cases": "counterfact",
    "Edit": "edit",
    "apply_edits": "edit",
    "load_edits": "edit",
    "restore_edits": "edit",
    "save_edits": "edit",
    "BatchEdit": "edit_batch",
    "ConflictingRequestsError": "errors",
    "EditError": "errors",
    "EditLoadError": "errors",
    "LayerKindError": "errors",
    "StatisticsError": "errors",
    "SubjectNotFoundError": "errors",
    "TokenizationError": "errors",
    "evaluate_cases": "evaluate",
    "score_case": "evaluate",
    "ContextTemplates": "keys",
    "compute_key": "keys",
    "context_activations": "keys",
    "generate_context_prefixes": "keys",
    "LinearLayer": "layers",
    "editable_graph": "layers",
    "resolve_layer": "layers",
    "DEFAULT_SMOLLM2_NODES": "defaults",
    "MEMIT": "memit",
    "MEMITConfig": "memit",
    "rank_one_factors": "rank_one",
    "rank_one_update": "rank_one",
    "solve_second_moment": "rank_one",
    "update_direction": "rank_one",
    "DEFAULT_SMOLLM2_NODE": "defaults",
    "ROME": "rome",
    "ROMEConfig": "rome_config",
    "SecondMoment": "stats",
    "SecondMomentSums": "stats",
    "save_second_moment": "stats",
    "second_moment_cache_file": "stats",
    "compute_second_moment": "stats",
    "compute_second_moments": "stats",
    "default_cache_dir": "stats",
    "layer_second_moment": "stats",
    "layer_second_moments": "stats",
    "statistics_fingerprint": "stats",
    "ValueObjective": "value",
    "ValueResult": "value",
    "ValueRunner": "value",
    "optimize_value": "value",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
