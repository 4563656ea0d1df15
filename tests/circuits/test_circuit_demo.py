"""The circuit demo's pipeline (demos/circuits/pipeline.py) on the tiny Llama with random skip transcoders: the
report's scores and top features come from the graph, each ablation's measured change is the intervention's, the
sign check reads the graph's edges, and the annotated graph.json carries the scores, top logits and snippets."""

from __future__ import annotations

import json

import torch

from demos.circuits.pipeline import graph_snippets, report_prompt, trace_graph, trace_prompt
from gradpatch.circuits import FeatureEdit, attribute, graph_influence, graph_scores, intervene, parse_node_id

from test_circuits import tiny_replacement


def test_trace_prompt_reports_the_graph_and_its_ablations(tmp_path) -> None:
    ids = torch.randint(3, 100, (1, 7), generator=torch.Generator().manual_seed(5))
    ids[0, 0] = 1
    replacement = tiny_replacement("llama", ids)
    pg, transcoders = replacement.pg, {layer: s.transcoder for layer, s in replacement.layers.items()}
    documents = [torch.randint(3, 100, (12,), generator=torch.Generator().manual_seed(i)) for i in range(4)]
    report = trace_prompt(pg, transcoders, ids, name="tiny", prompt="tiny prompt", decode=lambda t: f"<{t}>",
                          documents=documents, out=tmp_path / "tiny", max_feature_nodes=None, top_features=3,
                          n_ablate=2)
    graph = attribute(replacement, max_feature_nodes=None)
    unpruned = graph_influence(graph)
    assert (report.replacement_score, report.completeness_score) == graph_scores(graph, unpruned)
    assert report.answer == f"<{int(graph.logit_tokens[0])}>" and report.n_features == graph.n_features
    top = torch.argsort(unpruned.influence[:graph.n_features], descending=True)[:3].tolist()
    assert [(f.layer, f.position, f.feature) for f in report.features] == [
        tuple(graph.active_features[i].tolist()) for i in top]
    assert all(len(f.promotes) == 5 for f in report.features)
    answer_row = graph.rows[graph.n_features, :graph.n_features]
    assert report.ablations, "the answer has features of positive direct edge on this prompt"
    for ablation in report.ablations:
        assert all(edge > 0 for edge in ablation.edges)
        for (layer, position, feature), edge in zip(ablation.features, ablation.edges):
            column = [i for i in range(graph.n_features) if graph.active_features[i].tolist() == [layer, position,
                                                                                                   feature]]
            assert float(answer_row[column[0]]) == edge
        result = intervene(pg, transcoders, ids, [FeatureEdit(*f, "ablate") for f in ablation.features])
        answer = int(graph.logit_tokens[0])
        before, after = result.logits_before[0, -1].double(), result.logits_after[0, -1].double()
        expected = float((after[answer] - after.mean()) - (before[answer] - before.mean()))
        assert abs(ablation.change - expected) <= 1e-6 * max(1.0, abs(expected))
        assert ablation.agrees == (ablation.change < 0)
    frontend = json.loads((tmp_path / "tiny" / "graph.json").read_text())
    assert frontend["metadata"]["scores"]["replacement_score"] == report.replacement_score
    features = [node for node in frontend["nodes"] if node["feature_type"] == "cross layer transcoder"]
    assert features and all("top_logits" in node for node in features)
    assert (tmp_path / "tiny" / "interventions.json").is_file()


def test_prompts_sharing_one_snippet_pass_report_as_each_alone(tmp_path) -> None:
    """trace_graph for two prompts, graph_snippets once for both, report_prompt for each: the reports trace_prompt
    gives each prompt alone, and graph.json carries the snippets of every feature node that fired in the corpus."""
    prompts = [torch.randint(3, 100, (1, n), generator=torch.Generator().manual_seed(n)) for n in (6, 8)]
    for ids in prompts:
        ids[0, 0] = 1
    replacement = tiny_replacement("llama", prompts[0])
    pg, transcoders = replacement.pg, {layer: s.transcoder for layer, s in replacement.layers.items()}
    documents = [torch.randint(3, 100, (12,), generator=torch.Generator().manual_seed(i)) for i in range(4)]
    decode = lambda t: f"<{t}>"  # noqa: E731
    traced = [trace_graph(pg, transcoders, ids, name=f"p{i}", prompt="p", max_feature_nodes=None, top_features=3)
              for i, ids in enumerate(prompts)]
    snippets = graph_snippets(pg, transcoders, traced, documents, decode)
    assert set(snippets) == {(layer, feature) for t in traced for layer, _, feature in t.feature_keys()}
    for i, (ids, prompt_graph) in enumerate(zip(prompts, traced)):
        shared = report_prompt(pg, transcoders, prompt_graph, snippets=snippets, decode=decode, out=tmp_path / f"s{i}",
                               n_ablate=2)
        alone = trace_prompt(pg, transcoders, ids, name=f"p{i}", prompt="p", decode=decode, documents=documents,
                             out=tmp_path / f"a{i}", max_feature_nodes=None, top_features=3, n_ablate=2)
        assert shared.to_dict() == alone.to_dict()
        frontend = json.loads((tmp_path / f"s{i}" / "graph.json").read_text())
        nodes = [n for n in frontend["nodes"] if n["feature_type"] == "cross layer transcoder"]
        for node in nodes:
            layer, _, feature = parse_node_id(node["node_id"])
            fired = [s.text for s in snippets[(layer, feature)]]
            assert [s["text"] for s in node.get("top_snippets", [])] == fired
            assert bool(fired) == ("top_snippets" in node)
        assert any("top_snippets" in node for node in nodes)
