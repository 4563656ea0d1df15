"""A dictionary's NodePaths resolved in one place (``dictionary_nodes``, one error type for splicing, attribution
graphs and training), and where a splice's latents sit in the sequence (``first_position``) when the first
positions are left out (issue 61)."""

from __future__ import annotations

import pytest
import torch

from gradpatch import PatchableGraph, testing
from gradpatch.circuits import ReplacementModel
from gradpatch.dictionaries import (DictionaryConfigError, SparseAutoencoder, Transcoder, splice,
                                    trained_positions)
from gradpatch.dictionaries.splice import dictionary_nodes
from gradpatch.errors import NodePathError
from recipes.dictionary import DictionaryModule
from recipes.errors import RecipeConfigError

NODE = "model.layers_0.output"
IDS = testing.random_prompt_batch().clean  # [3, 6]
READ, WRITE = "model.layers_0.mlp.x", "model.layers_0.mlp.output"


def _sae(first: int = 0) -> SparseAutoencoder:
    return SparseAutoencoder(64, 128, "topk", k=4, node=NODE, exclude_first_positions=first,
                             generator=torch.Generator().manual_seed(0))


def test_the_nodes_come_from_the_arguments_then_the_config(llama_graph: PatchableGraph) -> None:
    assert dictionary_nodes(_sae()) == (NODE, NODE)
    assert dictionary_nodes(_sae(), "model.layers_1.output") == ("model.layers_1.output",) * 2
    transcoder = Transcoder(64, 32, activation="relu", input_node=READ, output_node=WRITE)
    assert dictionary_nodes(transcoder, pg=llama_graph) == (READ, WRITE)
    assert dictionary_nodes(transcoder, output_node=NODE) == (READ, NODE)
    with pytest.raises(NodePathError, match="model.layers_9.output"):
        dictionary_nodes(_sae(), "model.layers_9.output", pg=llama_graph)


def test_a_missing_node_is_one_error_for_every_caller(llama_graph: PatchableGraph) -> None:
    no_output = Transcoder(64, 32, activation="relu", input_node=READ)
    with pytest.raises(DictionaryConfigError, match="names no node to write: name the nodes"):
        dictionary_nodes(no_output)
    with pytest.raises(DictionaryConfigError, match="names no node to write") as spliced:
        splice(llama_graph, no_output)
    with pytest.raises(DictionaryConfigError, match="names no node to write") as traced:
        ReplacementModel(llama_graph, {0: no_output}, IDS[:1])
    with pytest.raises(RecipeConfigError, match="names no node to write") as trained:
        DictionaryModule(llama_graph, no_output)
    assert str(spliced.value) == str(traced.value) == str(trained.value)
    assert isinstance(trained.value.__cause__, DictionaryConfigError)  # the recipe's error, caused by the same one


def test_the_latents_name_their_first_position(llama_graph: PatchableGraph) -> None:
    whole, sliced = splice(llama_graph, _sae(), error_term=False), splice(llama_graph, _sae(2), error_term=False,
                                                                          slice=trained_positions(_sae(2)))
    assert whole.first_position is None and whole.latents is None  # before any pass
    with torch.no_grad(), llama_graph.patch(whole):
        llama_graph(IDS)
    with torch.no_grad(), llama_graph.patch(sliced):
        llama_graph(IDS)
    assert whole.first_position == 0 and whole.latents.shape == (3, 6, 128)
    assert sliced.first_position == 2 and sliced.latents.shape == (3, 4, 128)
    for position in range(2, 6):  # position p of the pass is latents[:, p - first_position]
        torch.testing.assert_close(sliced.latents[:, position - sliced.first_position], whole.latents[:, position])
    with torch.no_grad(), llama_graph.patch(sliced):
        llama_graph(IDS[:, :2])  # no position past the excluded ones: no latents, not the last pass's
    assert sliced.latents is None and sliced.first_position is None


def test_each_generation_step_names_its_first_position(llama_graph: PatchableGraph) -> None:
    sae = _sae(2)
    s = splice(llama_graph, sae, slice=trained_positions(sae), record=True)
    with torch.no_grad(), llama_graph.patch(s):
        llama_graph.generate(IDS[:1], max_new_tokens=2, do_sample=False)
    assert [z.shape[1] for z in s.patch.recorded] == [4, 1]  # the prompt's positions 2..5, then the new token
    assert s.first_position == 0  # the last step's one token, past the excluded positions
