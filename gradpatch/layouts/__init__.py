"""Where each model family keeps its parts: the one table of model layouts, asked by causal tracing, attribution, the
edge graph, circuits and the editors' defaults.

A :class:`ModelLayout` names, as NodePaths, a family's token embeddings, its transformer blocks (``layer``, ``{}``
standing for the block index) and, relative to a block, its input, its residual output, what its attention and its
MLP add to the residual stream, the attention's heads, queries, keys and values, the MLP's input, its norms (before
and after), a mixture of experts' router and experts, then the final norm and the unembedding's input. The table
(:data:`LAYOUTS`, :mod:`gradpatch.layouts.table`) holds one layout per family; :func:`detect_layout` accepts the
first whose NodePaths, shapes and block identities hold on the graph (:func:`check_layout`), and a graph of another
family gets one :class:`~gradpatch.errors.LayoutError` naming what failed for each. Any other family is a
``ModelLayout(...)`` of its own NodePaths (print ``pg.graph`` to find them), checked the same way.
"""

from .model_layout import BlockForm, ModelLayout
from .table import (
    COHERE_LAYOUT,
    FALCON_LAYOUT,
    GEMMA_LAYOUT,
    GPT2_LAYOUT,
    GPT_NEOX_LAYOUT,
    GPT_NEOX_SEQUENTIAL_LAYOUT,
    GPT_OSS_LAYOUT,
    GPTJ_LAYOUT,
    GRANITE_LAYOUT,
    LAYOUTS,
    LLAMA_LAYOUT,
    MOE_LAYOUT,
    OLMO2_LAYOUT,
    PHI3_LAYOUT,
    STABLELM_LAYOUT,
)
from .verify import (check_layout, count_layers, detect_layout, has_node, last_position_cut, layout_problems,
                     logits_input)

__all__ = ["BlockForm", "COHERE_LAYOUT", "FALCON_LAYOUT", "GEMMA_LAYOUT", "GPT2_LAYOUT",
           "GPTJ_LAYOUT", "GPT_NEOX_LAYOUT", "GPT_NEOX_SEQUENTIAL_LAYOUT", "GPT_OSS_LAYOUT", "GRANITE_LAYOUT",
           "LAYOUTS", "LLAMA_LAYOUT", "MOE_LAYOUT", "ModelLayout", "OLMO2_LAYOUT", "PHI3_LAYOUT", "STABLELM_LAYOUT",
           "check_layout", "count_layers", "detect_layout", "has_node", "last_position_cut", "layout_problems",
           "logits_input"]
