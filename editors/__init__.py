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

See docs/rome.md and docs/memit.md.
"""

from .alphaedit import AlphaEdit, AlphaEditConfig
from .batch_value import BatchValueObjective, optimize_values
from .corpus import Corpus, open_corpus, wiki_summaries, wiki_summaries_path
from .counterfact import CounterFactCase, EditRequest, load_cases, save_cases
from .edit import Edit, apply_edits, load_edits, restore_edits, save_edits
from .edit_batch import BatchEdit
from .errors import (ConflictingRequestsError, EditError, EditLoadError, LayerKindError, StatisticsError,
                     SubjectNotFoundError, TokenizationError)
from .evaluate import evaluate_cases, score_case
from .keys import ContextTemplates, compute_key, context_activations, generate_context_prefixes
from .layers import LinearLayer, resolve_layer
from .memit import DEFAULT_SMOLLM2_NODES, MEMIT, MEMITConfig
from .rank_one import rank_one_factors, rank_one_update, solve_second_moment
from .rome import DEFAULT_SMOLLM2_NODE, ROME, ROMEConfig
from .stats import (SecondMoment, compute_second_moment, compute_second_moments, default_cache_dir, layer_second_moment,
                    layer_second_moments, statistics_fingerprint)
from .value import ValueObjective, ValueResult, ValueRunner, optimize_value

__all__ = [
    "DEFAULT_SMOLLM2_NODE",
    "DEFAULT_SMOLLM2_NODES",
    "MEMIT",
    "ROME",
    "AlphaEdit",
    "AlphaEditConfig",
    "BatchEdit",
    "BatchValueObjective",
    "ConflictingRequestsError",
    "ContextTemplates",
    "Corpus",
    "CounterFactCase",
    "Edit",
    "EditError",
    "EditLoadError",
    "EditRequest",
    "LayerKindError",
    "LinearLayer",
    "MEMITConfig",
    "ROMEConfig",
    "SecondMoment",
    "StatisticsError",
    "SubjectNotFoundError",
    "TokenizationError",
    "ValueObjective",
    "ValueResult",
    "ValueRunner",
    "apply_edits",
    "compute_key",
    "compute_second_moment",
    "compute_second_moments",
    "context_activations",
    "default_cache_dir",
    "evaluate_cases",
    "generate_context_prefixes",
    "layer_second_moment",
    "layer_second_moments",
    "load_cases",
    "load_edits",
    "open_corpus",
    "optimize_value",
    "optimize_values",
    "rank_one_factors",
    "rank_one_update",
    "resolve_layer",
    "restore_edits",
    "save_cases",
    "save_edits",
    "score_case",
    "solve_second_moment",
    "statistics_fingerprint",
    "wiki_summaries",
    "wiki_summaries_path",
]
