"""One prompt through the circuit demo: its attribution graph over the trained transcoders, the scores, what its top
features read and write, and interventions on the features the graph says carry the answer.

For a prompt, :func:`trace_prompt` (or, for several prompts sharing one pass over the corpus, :func:`trace_graph`
for each, :func:`graph_snippets` for all, then :func:`report_prompt` for each)

1. builds the local replacement model and the attribution graph (circuit-tracer's method, :mod:`gradpatch.circuits`)
   and its replacement and completeness scores (circuit-tracer's definitions, :func:`gradpatch.circuits.graph_scores`);
2. takes the ``top_features`` feature nodes of greatest influence on the logits and, for each, its top activating
   corpus snippets (:func:`gradpatch.dictionaries.top_activating_snippets`, from ``documents``; computed for every
   feature node of the graph, which graph.html shows) and the tokens its decoder direction promotes through the
   unembedding (:func:`gradpatch.circuits.decoder_logit_weights`);
3. picks the ``n_ablate`` features with the largest positive direct edge into the answer's logit node (the most
   probable token) and ablates each alone, then all together, in the model with the transcoders spliced (error terms
   kept, attention frozen: circuit-tracer's default for interventions, :func:`gradpatch.circuits.intervene`). The
   graph predicts that ablating a feature whose edge into the answer is A > 0 lowers the answer's logit relative to the
   mean logit (the logit node's value); each ablation records whether the measured change has that sign;
4. writes graph.json / graph.html (annotated with the snippets, top logits and scores), the unpruned adjacency,
   TensorBoard summaries and ``interventions.json`` to ``out`` (:func:`recipes.reports.circuit_report.save_circuit`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch

from gradpatch import PatchableGraph
from gradpatch.circuits import (AttributionGraph, FeatureEdit, ReplacementModel, annotate_frontend, attribute,
                                graph_influence, graph_scores, intervene, node_label)
from gradpatch.dictionaries import SparseDictionary, Snippet, top_activating_snippets
from gradpatch.dictionaries.splice import dictionary_nodes
from recipes.reports.circuit_report import intervention_record, save_circuit

__all__ = ["Ablation", "FeatureSummary", "PromptReport", "TracedGraph", "graph_snippets", "report_prompt",
           "trace_graph", "trace_prompt"]


@dataclass
class FeatureSummary:
    """A feature node of the graph: where it is, its influence on the logits, what it reads and writes."""

    layer: int
    position: int
    feature: int
    activation: float
    influence: float
    label: str
    snippets: list[str]
    promotes: list[str]


@dataclass
class Ablation:
    """One ablation: the features ablated, the graph's direct edges from them into the answer's logit node, and the
    change of that node's value (answer logit − mean logit) it caused."""

    features: list[tuple[int, int, int]]
    edges: list[float]
    change: float
    top_before: list[tuple[str, float]]
    top_after: list[tuple[str, float]]

    @property
    def agrees(self) -> bool:
        """The graph predicted the sign: ablating features of positive total edge lowers the answer's logit."""
        return (self.change < 0) == (sum(self.edges) > 0)


@dataclass
class PromptReport:
    """What :func:`trace_prompt` found for one prompt (module docstring)."""

    name: str
    prompt: str
    answer: str
    answer_probability: float
    n_features: int
    total_features: int
    replacement_score: float
    completeness_score: float
    features: list[FeatureSummary] = field(default_factory=list)
    ablations: list[Ablation] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready record."""
        return {"name": self.name, "prompt": self.prompt, "answer": self.answer,
                "answer_probability": self.answer_probability, "n_features": self.n_features,
                "total_features": self.total_features, "replacement_score": self.replacement_score,
                "completeness_score": self.completeness_score,
                "features": [vars(f) for f in self.features],
                "ablations": [{**vars(a), "agrees": a.agrees} for a in self.ablations]}


def _answer_change(result: Any, answer: int) -> float:
    """The change of (answer logit − mean logit) at the last position between ``result``'s two passes."""
    before, after = result.logits_before[0, -1].double(), result.logits_after[0, -1].double()
    return float((after[answer] - after.mean()) - (before[answer] - before.mean()))


def _ablations(pg: PatchableGraph, transcoders: Mapping[int, SparseDictionary], traced: TracedGraph,
               decode: Callable[[int], str], n_ablate: int) -> list[Ablation]:
    """Each of the ``n_ablate`` features of largest positive direct edge into the answer's logit node of
    ``traced``'s graph ablated alone, then all of them together (module docstring, step 3)."""
    graph = traced.graph
    answer = int(graph.logit_tokens[0])
    edges = graph.rows[graph.n_features, :graph.n_features]  # the answer's logit row, feature columns
    chosen = [int(i) for i in torch.argsort(edges, descending=True)[:n_ablate] if float(edges[i]) > 0]
    groups = [[i] for i in chosen] + ([chosen] if len(chosen) > 1 else [])
    found = []
    for group in groups:
        features = traced.feature_keys(group)
        edits = [FeatureEdit(layer, position, feature, "ablate") for layer, position, feature in features]
        result = intervene(pg, transcoders, traced.ids, edits)
        record = intervention_record(result, edits, decode)
        found.append(Ablation(features, [float(edges[i]) for i in group], _answer_change(result, answer),
                              [(t["text"], t["probability"]) for t in record["top_before"][:3]],
                              [(t["text"], t["probability"]) for t in record["top_after"][:3]]))
    return found


@dataclass
class TracedGraph:
    """A prompt's attribution graph and what its report reads (:func:`trace_graph`, step 1 of the module docstring).

    Attributes:
        name, prompt: the prompt's short name and text.
        ids: its token ids ``[1, seq]``.
        replacement: its local replacement model.
        graph: its attribution graph; unpruned: the graph's influences (:func:`gradpatch.circuits.graph_influence`).
        replacement_score, completeness_score: circuit-tracer's scores of the graph.
        top: the indices of the ``top_features`` feature nodes of greatest influence, greatest first.
    """

    name: str
    prompt: str
    ids: torch.Tensor
    replacement: ReplacementModel
    graph: AttributionGraph
    unpruned: Any
    replacement_score: float
    completeness_score: float
    top: list[int]

    def feature_keys(self, indices: Sequence[int] | None = None) -> list[tuple[int, int, int]]:
        """(layer, position, feature) of the feature nodes at ``indices`` (default: every feature node)."""
        chosen = self.graph.active_features[:self.graph.n_features] if indices is None else \
            self.graph.active_features[list(indices)]
        return [tuple(int(v) for v in row) for row in chosen.tolist()]


def trace_graph(pg: PatchableGraph, transcoders: Mapping[int, SparseDictionary], ids: torch.Tensor, *, name: str,
                prompt: str, max_feature_nodes: int | None = 2000, top_features: int = 5) -> TracedGraph:
    """Step 1 of the module docstring for one prompt: the graph of ``ids`` ``[1, seq]`` (a special token first, as
    ``gradpatch circuit`` prepends) over ``transcoders`` (layer -> transcoder) in ``pg`` (``use_cache=False``), with
    at most ``max_feature_nodes`` features, its scores and its ``top_features`` most influential feature nodes."""
    replacement = ReplacementModel(pg, transcoders, ids)
    graph = attribute(replacement, max_feature_nodes=max_feature_nodes)
    unpruned = graph_influence(graph)
    replacement_score, completeness_score = graph_scores(graph, unpruned)
    top = torch.argsort(unpruned.influence[:graph.n_features], descending=True)[:top_features].tolist()
    return TracedGraph(name, prompt, ids, replacement, graph, unpruned, replacement_score, completeness_score, top)


def graph_snippets(pg: PatchableGraph, transcoders: Mapping[int, SparseDictionary], traced: Sequence[TracedGraph],
                   documents: Sequence[torch.Tensor], decode: Callable[[int], str],
                   k: int = 3) -> dict[tuple[int, int], list[Snippet]]:
    """The top ``k`` activating snippets (:func:`gradpatch.dictionaries.top_activating_snippets`) of every feature node
    of every graph in ``traced``, from one pass over ``documents`` (token ids ``[seq]`` each) for all of them:
    (layer, feature) -> snippets."""
    latents = [(layer, feature) for t in traced for layer, _, feature in t.feature_keys()]
    encoders = {layer: (dictionary_nodes(t)[0], t.encode) for layer, t in transcoders.items()}
    return top_activating_snippets(pg, encoders, latents, documents, lambda tokens: "".join(decode(t) for t in tokens),
                                   k=k)


def report_prompt(pg: PatchableGraph, transcoders: Mapping[int, SparseDictionary], traced: TracedGraph, *,
                  snippets: Mapping[tuple[int, int], Sequence[Snippet]], decode: Callable[[int], str],
                  out: str | Path, n_ablate: int = 3, node_threshold: float = 0.8,
                  edge_threshold: float = 0.98) -> PromptReport:
    """Steps 2–4 of the module docstring for a traced prompt: its top features summarised with their ``snippets``
    ((layer, feature) -> snippets, e.g. :func:`graph_snippets`; graph.html shows those of every feature node given),
    ``n_ablate`` ablations, and its files written to ``out`` (replaced whole if it exists), graph.json pruned at
    ``node_threshold`` / ``edge_threshold``."""
    graph, replacement, unpruned = traced.graph, traced.replacement, traced.unpruned
    influence = unpruned.influence[:graph.n_features]
    ablations = _ablations(pg, transcoders, traced, decode, n_ablate)
    annotate = partial(annotate_frontend, graph=graph, replacement=replacement, decode=decode, unpruned=unpruned,
                       snippets=snippets)
    record = {"ablations": [{**vars(a), "agrees": a.agrees} for a in ablations]}
    save_circuit(graph, out, decode=decode, prompt=traced.prompt, slug=None, node_threshold=node_threshold,
                 edge_threshold=edge_threshold, unpruned=unpruned, intervention=record, annotate=annotate)
    prompt_tokens = [decode(token) for token in traced.ids[0].tolist()]
    features = []
    for index, (layer, position, feature) in zip(traced.top, traced.feature_keys(traced.top)):
        frontend_node = {"node_id": f"{layer}_{feature}_{position}", "layer": str(layer), "ctx_idx": position,
                         "feature_type": "cross layer transcoder", "feature": feature}
        promoted = annotate_frontend({"metadata": {}, "nodes": [frontend_node], "links": []}, graph, replacement,
                                     decode, unpruned, top_k=5)["nodes"][0]["top_logits"]
        features.append(FeatureSummary(layer, position, feature, float(graph.activations[index]),
                                       float(influence[index]), node_label(frontend_node, prompt_tokens),
                                       [s.text for s in snippets.get((layer, feature), [])],
                                       [p["text"] for p in promoted]))
    answer = int(graph.logit_tokens[0])
    return PromptReport(traced.name, traced.prompt, decode(answer), float(graph.logit_probabilities[0]),
                        graph.n_features, graph.total_features or graph.n_features, traced.replacement_score,
                        traced.completeness_score, features, ablations)


def trace_prompt(pg: PatchableGraph, transcoders: Mapping[int, SparseDictionary], ids: torch.Tensor, *, name: str,
                 prompt: str, decode: Callable[[int], str], documents: Sequence[torch.Tensor], out: str | Path,
                 max_feature_nodes: int | None = 2000, top_features: int = 5, n_ablate: int = 3,
                 node_threshold: float = 0.8, edge_threshold: float = 0.98) -> PromptReport:
    """Trace one prompt (module docstring: :func:`trace_graph`, :func:`graph_snippets`, :func:`report_prompt`) and
    write its files to ``out``.

    Args:
        pg: the model's graph (``use_cache=False``).
        transcoders: layer -> transcoder (configs naming the MLP input and output NodePaths).
        ids: the prompt's ids ``[1, seq]`` (a special token first, as ``gradpatch circuit`` prepends).
        name, prompt: the prompt's short name and text (for the report and graph.json).
        decode: token id -> text.
        documents: the corpus the top activating snippets are taken from (token ids ``[seq]`` each).
        out: the prompt's output folder (replaced whole if it exists).
        max_feature_nodes: the features the graph keeps at most (circuit-tracer's rounds).
        top_features: feature nodes summarised; n_ablate: features ablated.
        node_threshold, edge_threshold: graph.json's pruning.

    Returns:
        A :class:`PromptReport`.
    """
    traced = trace_graph(pg, transcoders, ids, name=name, prompt=prompt, max_feature_nodes=max_feature_nodes,
                         top_features=top_features)
    snippets = graph_snippets(pg, transcoders, [traced], documents, decode)
    return report_prompt(pg, transcoders, traced, snippets=snippets, decode=decode, out=out, n_ablate=n_ablate,
                         node_threshold=node_threshold, edge_threshold=edge_threshold)
