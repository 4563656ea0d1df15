"""The one model-layout table: families detected from the graph, one error for a model of another family."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from editors.causal_trace import GPT2_PATHS, LLAMA_PATHS, ModelPaths, TraceError, detect_model_paths
from gradpatch import LayoutError, ModelLayout, PatchableGraph
from gradpatch.attribution import GPT2_FAMILY, LLAMA_FAMILY, AttributionError, ModelFamily, detect_family
from gradpatch.layouts import GPT2_LAYOUT, LLAMA_LAYOUT, count_layers, detect_layout, has_node, logits_input


def test_the_families_of_tracing_and_attribution_are_the_one_table() -> None:
    assert ModelPaths is ModelFamily is ModelLayout
    assert LLAMA_PATHS is LLAMA_FAMILY is LLAMA_LAYOUT and GPT2_PATHS is GPT2_FAMILY is GPT2_LAYOUT
    assert LLAMA_LAYOUT.path("mlp", 3) == "model.layers_3.mlp.output"
    assert LLAMA_LAYOUT.path("resid", 2) == LLAMA_LAYOUT.path("hidden", 2) == "model.layers_2.output"
    assert GPT2_LAYOUT.path("heads", 0) == "transformer.h_0.attn.c_proj.x"
    with pytest.raises(LayoutError, match="'layer' is not a part of a block"):
        LLAMA_LAYOUT.path("layer", 0)


def test_a_known_family_is_detected(llama_graph, gpt2_graph) -> None:
    assert detect_layout(llama_graph) is LLAMA_LAYOUT
    assert count_layers(llama_graph, LLAMA_LAYOUT) == 2
    assert has_node(llama_graph, "model.layers_1.mlp.output") and not has_node(llama_graph, "model.layers_2")
    assert logits_input(llama_graph) == "lm_head.input"
    assert logits_input(llama_graph, ModelLayout(logits_input=None)) is None
    assert detect_layout(gpt2_graph) is GPT2_LAYOUT


def test_a_model_of_another_family_gets_one_error_naming_what_was_looked_for() -> None:
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10)).eval()
    pg = PatchableGraph(model, torch.zeros(1, 3, dtype=torch.long))
    for detect, domain in ((detect_layout, LayoutError), (detect_model_paths, TraceError),
                           (detect_family, AttributionError)):
        with pytest.raises(domain, match="looked for llama: model.embed_tokens.output and model.layers_0") as caught:
            detect(pg)
        assert isinstance(caught.value, LayoutError)
    with pytest.raises(LayoutError, match="no block 'model.layers_0'"):
        count_layers(pg, LLAMA_LAYOUT)


def test_templates_name_a_part_at_every_layer_and_the_circuits_default_to_the_layouts() -> None:
    from gradpatch.circuits import LLAMA_MLP_INPUT, LLAMA_MLP_OUTPUT
    from gradpatch.layouts import GEMMA_LAYOUT, GPT2_LAYOUT

    assert (LLAMA_MLP_INPUT, LLAMA_MLP_OUTPUT) == ("model.layers_{layer}.mlp.x", "model.layers_{layer}.mlp.output")
    assert LLAMA_LAYOUT.template("mlp_input") == LLAMA_MLP_INPUT
    assert GEMMA_LAYOUT.template("mlp").format(layer=3) == "model.layers_3.post_feedforward_layernorm.output"
    assert GPT2_LAYOUT.template("mlp_input").format(layer=11) == GPT2_LAYOUT.path("mlp_input", 11)
    with pytest.raises(LayoutError, match="'layer' is not a part of a block"):
        LLAMA_LAYOUT.template("layer")
