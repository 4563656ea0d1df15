"""gradpatch.capture.node_activations (moved from editors.passes.capture, issue 61): several nodes in one forward
pass, detached, stopped after the deepest node read; editors keep re-exporting it."""

from __future__ import annotations

import pytest
import torch

from gradpatch import AddPatch, PatchableGraph, ProbePatch, node_activations, testing
from gradpatch.capture import node_activations as from_module
from gradpatch.errors import NodePathError

IDS = testing.random_prompt_batch().clean  # [3, 6]
EARLY, LATE = "model.layers_0.mlp.down_proj.input", "model.layers_1.output"


def test_the_activations_are_those_of_a_probed_pass(llama_graph: PatchableGraph) -> None:
    probes = {EARLY: ProbePatch(), LATE: ProbePatch()}
    with torch.no_grad(), llama_graph.patch(probes):
        llama_graph(IDS, use_cache=False)
    late, early, again = node_activations(llama_graph, [LATE, EARLY, LATE], IDS)
    assert torch.equal(early, probes[EARLY].activation) and torch.equal(late, probes[LATE].activation)
    assert torch.equal(again, late) and not late.requires_grad


def test_the_pass_stops_after_the_deepest_node(llama_graph: PatchableGraph) -> None:
    later = ProbePatch()
    node_activations(llama_graph, [EARLY], IDS, patches={LATE: later})
    assert later.activation is None  # layer 1 never ran
    node_activations(llama_graph, [EARLY], IDS, stop=False, patches={LATE: later})
    assert later.activation is not None


def test_extra_patches_run_before_the_read(llama_graph: PatchableGraph) -> None:
    (plain,) = node_activations(llama_graph, [LATE], IDS)
    (shifted,) = node_activations(llama_graph, [LATE], IDS, patches={LATE: AddPatch(value=1.0)})
    torch.testing.assert_close(shifted, plain + 1.0)


def test_an_unknown_node_is_refused(llama_graph: PatchableGraph) -> None:
    with pytest.raises(NodePathError, match="model.layers_9.output"):
        node_activations(llama_graph, ["model.layers_9.output"], IDS)


def test_editors_re_export_the_engines_helper() -> None:
    from editors.passes import node_activations as from_editors
    from editors.passes.capture import node_activations as from_capture

    assert from_editors is from_module and from_capture is from_module and node_activations is from_module

