"""Top activating snippets: for chosen latents of dictionaries, the corpus contexts where they fire most, the first
thing a researcher reads to name a feature (Bricken et al. 2023, "Towards Monosemanticity", feature visualisation;
circuit-tracer's and Neuronpedia's "top activations").

Each document runs once through the model without gradients, stopping after the deepest input node read
(:func:`gradpatch.capture.node_activations`); each dictionary encodes its input there, and a running top-k per latent
keeps (activation, document, position), merged with each document's top k for all of a layer's latents at once. A
snippet is the ``context`` tokens up to and including the activating one, that token marked ``«…»``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from ..capture import node_activations
from .errors import DictionaryConfigError

__all__ = ["Encoder", "Snippet", "top_activating_snippets"]

#: What a layer's dictionary reads and how it encodes: (input NodePath, x ``[..., d_in]`` -> latents ``[..., m]``).
Encoder = tuple[str, Callable[[torch.Tensor], torch.Tensor]]


@dataclass(frozen=True)
class Snippet:
    """One context where a latent fired.

    Attributes:
        text: the decoded context, the activating token marked ``«…»``.
        activation: the latent's value there.
        document: the document's index in the corpus given.
        position: the activating token's position in that document.
    """

    text: str
    activation: float
    document: int
    position: int


def top_activating_snippets(pg: torch.nn.Module, encoders: Mapping[int, Encoder],
                            latents: Sequence[tuple[int, int]], documents: Sequence[torch.Tensor],
                            decode: Callable[[list[int]], str], k: int = 5, context: int = 12,
                            skip_first_positions: int = 1) -> dict[tuple[int, int], list[Snippet]]:
    """The ``k`` top activating snippets of each (layer, latent).

    Args:
        pg: the :class:`~gradpatch.PatchableGraph` of the model.
        encoders: layer -> :data:`Encoder` (e.g. ``(dictionary_nodes(t)[0], t.encode)`` for a transcoder, or a CLT
            layer's input node and ``functools.partial(clt.encode, layer)``).
        latents: the (layer, latent index) pairs wanted; each layer must be in ``encoders``.
        documents: token ids ``[seq]`` per document (e.g. :func:`recipes.dictionary.corpus.tokenize_documents`).
        decode: token ids -> text (a tokenizer's ``decode``).
        k: snippets per latent, at most (fewer where it fires at fewer positions; it must be > 0 there).
        context: tokens shown up to and including the activating one.
        skip_first_positions: positions of each document never counted (attention sinks: a sequence's first
            token has outsized activations in most models; circuit-tracer leaves position 0 out of its graphs).

    Returns:
        (layer, latent) -> snippets, highest activation first.

    Raises:
        DictionaryConfigError: a latent whose layer has no encoder, ``k`` or ``context`` below 1.
    """
    if k < 1 or context < 1:
        raise DictionaryConfigError(f"k={k}, context={context}: give at least 1 of each")
    missing = sorted({layer for layer, _ in latents} - set(encoders))
    if missing:
        raise DictionaryConfigError(f"latents of layers {missing} were asked for, but encoders are given for layers "
                                    f"{sorted(encoders)}; give an encoder for each layer")
    wanted: dict[int, list[int]] = {}
    for layer, latent in dict.fromkeys(latents):
        wanted.setdefault(layer, []).append(latent)
    layers = sorted(wanted)
    nodes = [encoders[layer][0] for layer in layers]
    # Per layer, the running top k of each wanted latent: values [k, n] (-inf: none yet), documents and positions.
    best = {layer: (torch.full((k, len(wanted[layer])), -torch.inf),
                    *(torch.zeros((k, len(wanted[layer])), dtype=torch.long) for _ in range(2))) for layer in layers}
    chosen = {layer: torch.tensor(wanted[layer]) for layer in layers}
    for index, ids in enumerate(documents):
        ids = ids.reshape(1, -1)
        if ids.shape[1] <= skip_first_positions:
            continue
        values = node_activations(pg, nodes, ids)
        for layer, x in zip(layers, values):
            z = encoders[layer][1](x)[0, skip_first_positions:].float().cpu()[:, chosen[layer]]  # [seq - skip, n]
            top = torch.topk(z, min(k, z.shape[0]), dim=0)
            kept_values, kept_documents, kept_positions = best[layer]
            merged = torch.cat([kept_values, top.values])
            order = torch.topk(merged, k, dim=0).indices  # [k, n]: rows of merged
            sources = torch.cat([kept_documents, torch.full_like(top.indices, index)])
            positions = torch.cat([kept_positions, top.indices + skip_first_positions])
            best[layer] = (merged.gather(0, order), sources.gather(0, order), positions.gather(0, order))
    found: dict[tuple[int, int], list[Snippet]] = {}
    for layer in layers:
        kept_values, kept_documents, kept_positions = (t.T.tolist() for t in best[layer])  # [n, k] each
        for column, latent in enumerate(wanted[layer]):
            snippets = []
            for value, document, position in zip(kept_values[column], kept_documents[column], kept_positions[column]):
                if value <= 0:
                    break
                tokens = documents[document].reshape(-1).tolist()
                before = decode(tokens[max(0, position - context + 1):position])
                snippets.append(Snippet(f"{before}«{decode([tokens[position]])}»", value, document, position))
            found[(layer, latent)] = snippets
    return {key: found[key] for key in dict.fromkeys(latents)}
