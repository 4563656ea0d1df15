"""HoldPatch: the live value at a node, with its autograd history (issue 61); the one hold patch that transcoder
inputs, attribution-graph backward passes, path checks and end-to-end training's downstream values use."""

from __future__ import annotations

import pytest
import torch

from gradpatch import HoldPatch, PatchableGraph, ProbePatch, testing
from gradpatch.dictionaries import TranscoderInput
from gradpatch.positions import Tokens

NODE = "model.layers_0.output"
LATER = "model.layers_1.output"
IDS = testing.random_prompt_batch().clean  # [3, 6]


def test_the_held_value_is_the_live_value_with_its_history(llama_graph: PatchableGraph) -> None:
    hold, probe = HoldPatch(), ProbePatch()
    assert hold.held is None
    with llama_graph.patch({NODE: [hold, probe]}):
        logits = llama_graph(IDS).logits
    assert hold.held.shape == (3, 6, 64) and hold.held.grad_fn is not None  # not detached
    assert torch.equal(hold.held, probe.activation)  # the value passed on unchanged
    with llama_graph.patch({NODE: ProbePatch()}):
        assert torch.equal(llama_graph(IDS).logits, logits)
    loss = hold.held.square().sum()
    loss.backward()  # differentiable to the model's parameters
    assert any(p.grad is not None for p in llama_graph.parameters())


def test_a_leaf_gives_the_gradient_at_its_node_and_stops_it_there(llama_graph: PatchableGraph) -> None:
    reference = HoldPatch()
    with llama_graph.patch({NODE: reference}):
        expected = torch.autograd.grad(llama_graph(IDS).logits.logsumexp(-1).sum(), reference.held)[0]
    leaf = HoldPatch(leaf=True)
    with llama_graph.patch({NODE: leaf}):
        loss = llama_graph(IDS).logits.logsumexp(-1).sum()
    assert leaf.held.is_leaf and leaf.held.requires_grad
    torch.testing.assert_close(torch.autograd.grad(loss, leaf.held, retain_graph=True)[0], expected)
    embedding = next(p for name, p in llama_graph.named_parameters() if "embed" in name)
    assert torch.autograd.grad(loss, embedding, allow_unused=True)[0] is None  # nothing flows upstream of the leaf


def test_a_slice_holds_the_selected_positions(llama_graph: PatchableGraph) -> None:
    sliced, whole = HoldPatch(slice=(slice(None), slice(2, None))), HoldPatch()
    with llama_graph.patch({NODE: [sliced, whole]}):
        llama_graph(IDS)
    assert torch.equal(sliced.held, whole.held[:, 2:])
    nothing = HoldPatch(slice=Tokens(slice(10, None)))  # no position of a 6-token pass
    with llama_graph.patch({NODE: nothing}):
        llama_graph(IDS)
    assert nothing.held is None


def test_a_sliced_leaf_stops_the_gradient_at_its_positions_only(llama_graph: PatchableGraph) -> None:
    leaf, upstream = HoldPatch(leaf=True, slice=(slice(None), slice(4, None))), HoldPatch()
    with llama_graph.patch({"model.embed_tokens.output": upstream, NODE: leaf}):
        loss = llama_graph(IDS).logits[:, -1].logsumexp(-1).sum()
    assert leaf.held.shape == (3, 2, 64) and leaf.held.is_leaf
    to_embeddings = torch.autograd.grad(loss, upstream.held)[0]
    assert to_embeddings[:, 4:].abs().sum() == 0 and to_embeddings[:, :4].abs().sum() > 0


def test_a_transcoder_input_is_a_hold_patch_with_a_width() -> None:
    reader = TranscoderInput(width=64)
    assert isinstance(reader, HoldPatch) and reader.held is None
    with pytest.raises(Exception, match="input width is 64"):
        reader.check_width(32, NODE)
