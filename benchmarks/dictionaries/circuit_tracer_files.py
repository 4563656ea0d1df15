"""Files against circuit-tracer 0.5.0: transcoder sets each library writes are read by the other with the same
latents and outputs, and gradpatch's graph.json reads back, node for node, through circuit-tracer's own decoder.

1. ``exported``: gradpatch exports two random ReLU/JumpReLU skip transcoders (d_model 32, 96 latents; and a square
   set, 32 latents, whose orientation only the files' metadata records) with
   :func:`gradpatch.dictionaries.export_circuit_tracer`; circuit-tracer
   (benchmarks/peers/circuit_tracer/formats_side.py, in its own virtualenv) loads each with 0.5.0's ``load_transcoders`` (the config's list) and its cache loader
   (``layer_<i>`` files) and writes its latents and outputs on seeded inputs, which gradpatch's transcoders are
   compared with.
2. ``written``: circuit-tracer builds a set with its own ``SingleLayerTranscoder`` / ``TranscoderSet.to_safetensors``;
   gradpatch loads it with :func:`gradpatch.dictionaries.load_circuit_tracer` and the outputs are compared.
3. ``graph_json``: gradpatch builds the attribution graph of the tiny Llama with random skip transcoders and writes
   graph.json (:func:`gradpatch.circuits.save_graph`); it is validated against Neuronpedia's graph schema
   (tests/circuits/neuronpedia_graph_schema.json, jsonschema) and circuit-tracer's frontend pydantic ``Model``, and
   circuit-tracer's ``decode_url_features`` reads every node id (as pinned ids, and the non-embedding ones as a
   supernode): each must give the node's own layer, position and feature (a feature's from its Cantor-paired
   ``feature``, an error's -1, a token's id).

Prints JSON: per set, direction and layer the largest absolute differences, and the graph's counts of nodes read back
and mismatches. Exits non-zero when a set does not load, a difference exceeds 1e-5, or any id reads back wrong.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.dictionaries.circuit_tracer_files`` (circuit-tracer 0.5.0 in
``.peers/circuit_tracer``, ``make peers PEERS=circuit_tracer``; ``--python`` names another virtualenv's Python).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

import jsonschema
import torch
from safetensors.torch import load_file

from benchmarks.harness import ROOT, emit, peer_python, peer_version, run_module
from gradpatch import PatchableGraph, testing
from gradpatch.circuits import ReplacementModel, attribute, cantor_unpair, save_graph
from gradpatch.dictionaries import SkipTranscoder, SparseDictionary, export_circuit_tracer, load_circuit_tracer

SIDE = "benchmarks.peers.circuit_tracer.formats_side"
D_MODEL, D_SAE = 32, 96
TOLERANCE = 1e-5
NODES = ("in{layer}", "out{layer}")


def random_set(d_sae: int, seed: int) -> dict[int, SparseDictionary]:
    """Two skip transcoders, layer 0 JumpReLU and layer 1 ReLU, random weights."""
    generator = torch.Generator().manual_seed(seed)
    transcoders: dict[int, SparseDictionary] = {}
    for layer, activation in enumerate(("jumprelu", "relu")):
        transcoder = SkipTranscoder(D_MODEL, d_sae, activation=activation, generator=generator)
        with torch.no_grad():
            for parameter in transcoder.parameters():
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
            if activation == "jumprelu":
                transcoder.threshold.copy_(torch.rand(d_sae, generator=generator) * 0.3)
        transcoders[layer] = transcoder
    return transcoders


def compare(transcoders: dict[int, SparseDictionary], folder: Path) -> dict[str, dict[str, float]]:
    """Largest absolute differences between ``transcoders`` and circuit-tracer's outputs saved in ``folder``."""
    report = {}
    for layer, transcoder in transcoders.items():
        reference = load_file(str(folder / f"circuit_tracer_outputs_{layer}.safetensors"))
        with torch.no_grad():
            ours = {"latents": transcoder.encode(reference["x"]), "forward": transcoder(reference["x"])}
        report[f"layer_{layer}"] = {name: float((ours[name] - reference[name]).abs().max()) for name in ours}
        report[f"layer_{layer}"] |= {f"cache_{name}": float((ours[name] - reference[f"cache_{name}"]).abs().max())
                                     for name in ours if f"cache_{name}" in reference}
    return report


def graph_json(python: str, folder: Path) -> dict[str, Any]:
    """Write a tiny graph's graph.json, validate it and read its ids back with circuit-tracer (module docstring)."""
    model = testing.tiny_llama(100, hidden=64, intermediate=128, init_std=0.02, max_position_embeddings=128,
                               pad_token_id=None, bos_token_id=1, eos_token_id=2)
    ids = torch.randint(0, 100, (1, 7), generator=torch.Generator().manual_seed(3))
    pg = PatchableGraph(model, ids, use_cache=False)
    generator = torch.Generator().manual_seed(0)
    transcoders = {layer: SkipTranscoder(64, 64, activation="relu", input_node=f"model.layers_{layer}.mlp.x",
                                         output_node=f"model.layers_{layer}.mlp.output", generator=generator)
                   for layer in range(2)}
    graph = attribute(ReplacementModel(pg, transcoders, ids), batch_size=32, zero_first_position=False)
    save_graph(graph, folder, prompt="tiny prompt", scan="tiny-llama", node_threshold=1.0, edge_threshold=1.0)
    document = json.loads((folder / "graph.json").read_text())
    schema = json.loads((ROOT / "tests" / "circuits" / "neuronpedia_graph_schema.json").read_text())
    schema_errors = [error.message for error in jsonschema.Draft7Validator(schema).iter_errors(document)]
    stdout = run_module(python, SIDE, ["decode", str(folder / "graph.json")]).stdout
    decoded = json.loads(stdout.strip().splitlines()[-1])
    tokens = graph.input_tokens.tolist()
    mismatches = []
    for node in document["nodes"]:
        kind, layer, position = node["feature_type"], node["layer"], node["ctx_idx"]
        if kind == "embedding":
            expected = [-1, position, tokens[position]]
        elif kind == "cross layer transcoder":
            expected = [int(layer), position, cantor_unpair(node["feature"])[1]]
        else:
            expected = [int(layer), position, -1 if kind == "mlp reconstruction error" else node["feature"]]
        for route in ("pinned", "supernode"):
            got = decoded[route].get(node["node_id"])
            if (got is not None or route == "pinned") and got != expected:
                mismatches.append({"node_id": node["node_id"], "route": route, "expected": expected, "got": got})
    return {"nodes": len(document["nodes"]), "links": len(document["links"]),
            "pinned_read_back": decoded["pinned_count"], "supernode_read_back": len(decoded["supernode"]),
            "pydantic_nodes": decoded["pydantic_nodes"], "schema_errors": schema_errors[:5],
            "id_mismatches": mismatches[:5], "n_id_mismatches": len(mismatches)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", help="the Python of circuit-tracer 0.5.0's virtualenv (default: "
                                          ".peers/circuit_tracer/bin/python)")
    args = parser.parse_args()
    python = peer_python("circuit_tracer", args.python)
    report: dict[str, Any] = {"circuit_tracer": peer_version(python, "circuit-tracer")}
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        for name, d_sae in (("exported", D_SAE), ("exported_square", D_MODEL)):
            transcoders = random_set(d_sae, seed=1)
            config = export_circuit_tracer(transcoders, root / name, "random", "hook_resid_mid", "hook_mlp_out")
            run_module(python, SIDE, ["outputs", str(config)])
            reloaded = load_circuit_tracer(config, *NODES)  # the square set: its metadata decides
            report[name] = compare(transcoders, config.parent)
            report[name]["reloaded_equal"] = all(torch.equal(reloaded[i].W_dec, transcoders[i].W_dec) for i in (0, 1))
        run_module(python, SIDE, ["write", str(root / "written"), str(D_MODEL), str(D_SAE)])
        report["written"] = compare(load_circuit_tracer(root / "written", *NODES), root / "written")
        report["graph_json"] = graph_json(python, root / "graph")
    emit(report)
    worst = max(value for name in ("exported", "exported_square", "written") for layer in report[name].values()
                if isinstance(layer, dict) for value in layer.values())
    graph = report["graph_json"]
    if worst > TOLERANCE or graph["n_id_mismatches"] or graph["schema_errors"] or \
            graph["pinned_read_back"] != graph["nodes"] or \
            not all(report[name]["reloaded_equal"] for name in ("exported", "exported_square")):
        raise SystemExit(f"circuit-tracer disagrees: largest difference {worst:.3g} (tolerance {TOLERANCE}), "
                         f"{graph['n_id_mismatches']} ids read back wrong, schema errors {graph['schema_errors']}")


if __name__ == "__main__":
    main()
