"""Gradient attribution over the op graph: the exact activation-patching sweep and its gradient estimates.

::

    from gradpatch.attribution import atp, exact_sweep, prompt_batch

    batch = prompt_batch(tokenizer, [{"clean": "...", "corrupted": "...", "answer": " Mary", "foil": " John"}])
    exact = exact_sweep(pg, batch, "heads", forward_kwargs={"use_cache": False})
    estimate = atp(pg, batch, "heads", forward_kwargs={"use_cache": False})  # steps=5 for AtP-IG

Results are records (node, position, head, score); files, heatmaps and TensorBoard are in ``recipes/``.
"""

from .atp import atp
from .atp_star import atp_star
from .edge_graph import EdgeGraph
from .edges import eap, edge_patching
from .errors import AttributionError
from .exact import exact_sweep
from .metrics import Metric, answer_probability, kl_to_clean, logit_difference
from .methods import METHODS, run_method
from .nodes import (GPT2_FAMILY, KINDS, LLAMA_FAMILY, QK_KINDS, ModelFamily, Node, Unit, detect_family,
                    resolve_nodes)
from .prompts import PromptBatch, prompt_batch
from .records import AttributionResult, EdgeScore, NodeScore
from .verify import verify_top

__all__ = [
    "GPT2_FAMILY", "KINDS", "LLAMA_FAMILY", "METHODS", "QK_KINDS", "AttributionError", "AttributionResult",
    "EdgeGraph", "EdgeScore", "Metric", "ModelFamily", "Node", "NodeScore", "PromptBatch", "Unit",
    "answer_probability", "atp", "atp_star", "detect_family", "eap", "edge_patching", "exact_sweep", "kl_to_clean",
    "logit_difference", "prompt_batch", "resolve_nodes", "run_method", "verify_top",
]
