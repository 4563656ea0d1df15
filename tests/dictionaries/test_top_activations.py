"""Top activating snippets of transcoder latents on the tiny Llama: the activations reported are the latents' values
at those positions in a full spliced forward pass, highest first, at most k, never at skipped positions, and bad
requests are refused."""

from __future__ import annotations

import pytest
import torch

from gradpatch.dictionaries import DictionaryConfigError, Transcoder, splice
from gradpatch.dictionaries.top_activations import top_activating_snippets

MLP_IN, MLP_OUT = "model.layers_{}.mlp.x", "model.layers_{}.mlp.output"


def _transcoders() -> dict[int, Transcoder]:
    found = {}
    for layer in (0, 1):
        t = Transcoder(64, 48, activation="relu", input_node=MLP_IN.format(layer), output_node=MLP_OUT.format(layer),
                       generator=torch.Generator().manual_seed(layer))
        with torch.no_grad():
            t.b_enc.fill_(0.05)
        found[layer] = t
    return found


def _documents() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    return [torch.randint(1, 100, (n,), generator=generator) for n in (9, 7, 12, 1)]


def test_snippets_are_the_highest_latent_values_of_the_corpus(llama_graph) -> None:
    transcoders, documents = _transcoders(), _documents()
    encoders = {layer: (t.config.input_node, t.encode) for layer, t in transcoders.items()}
    latents = [(0, 3), (1, 7), (1, 20)]
    found = top_activating_snippets(llama_graph, encoders, latents, documents, decode=lambda ids: " ".join(map(str, ids)),
                                    k=3, context=4)
    for layer, latent in latents:
        values = []  # every (value, document, position) of the latent, from a spliced forward pass per document
        for index, ids in enumerate(documents):
            s = splice(llama_graph, transcoders[layer])
            with llama_graph.patch(s.patch_map()):
                llama_graph(ids.reshape(1, -1))
            values += [(float(v), index, p) for p, v in enumerate(s.latents[0, :, latent]) if p >= 1 and v > 0]
        expected = sorted(values, reverse=True)[:3]
        snippets = found[(layer, latent)]
        assert len(snippets) == len(expected) > 0
        for snippet, (value, index, position) in zip(snippets, expected):
            assert (snippet.document, snippet.position) == (index, position)
            assert snippet.activation == pytest.approx(value, rel=1e-5)
            tokens = documents[index].tolist()
            assert snippet.text.endswith(f"«{tokens[position]}»")
            assert len(snippet.text.split()) <= 4  # the context, the activating token included
        assert [s.activation for s in snippets] == sorted((s.activation for s in snippets), reverse=True)


def test_bad_requests_are_refused(llama_graph) -> None:
    t = _transcoders()[0]
    with pytest.raises(DictionaryConfigError, match="layers \\[1\\]"):
        top_activating_snippets(llama_graph, {0: (t.config.input_node, t.encode)}, [(1, 0)], _documents(), str)
    with pytest.raises(DictionaryConfigError, match="at least 1"):
        top_activating_snippets(llama_graph, {0: (t.config.input_node, t.encode)}, [(0, 0)], _documents(), str, k=0)
