"""Attribution graphs over a cross-layer transcoder (CLT) side by side with circuit-tracer 0.5.0: the same model,
random CLT and prompt; the active feature nodes, the logit nodes and the adjacency matrices compared; prints JSON.

Models as benchmarks/circuits/circuit_tracer_graphs.py builds them (``tiny-llama``: the test suite's 2-layer Llama,
d_model 64, the BOS token and ``--tokens`` − 1 random ids; ``smollm2``: the embedded SmolLM2-135M, 30 layers, the BOS
token and a prefix of a fixed text). The CLT covers every layer (reading each MLP's input, writing its output), has
``--latents`` latents per layer, no skip term, seed 0 weights (:class:`gradpatch.dictionaries.CrossLayerTranscoder`'s
initialisation), ``b_enc`` = 0.01 (slightly positive) and ``b_dec`` ~ N(0, 0.01²). ``--activation jumprelu``: each
layer's threshold is the midpoint between the ``k·(seq − 1)``-th and next largest pre-activation on the prompt's
positions ≥ 1 (``--k`` latents active per position on average, no pre-activation near the threshold); ``relu``:
``b_enc`` stays 0.01, so about half the latents fire (tiny models only). The CLT is exported with
:func:`gradpatch.dictionaries.export_circuit_tracer_clt`; circuit-tracer loads it with its ``load_clt``
(benchmarks/peers/circuit_tracer/clt_graphs_side.py) and gradpatch reads the same files back with
:func:`gradpatch.dictionaries.load_circuit_tracer_clt`. The comparison (position 0 zeroed on both sides, node order,
figures) is circuit_tracer_graphs.py's :func:`~benchmarks.circuits.circuit_tracer_graphs.compare`.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.circuits.circuit_tracer_clt_graphs --model tiny-llama
--activation relu`` (``--model smollm2 --tokens 16 --latents 128 --k 2``).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from benchmarks.circuits.circuit_tracer_graphs import (NODES, build_model, compare, mlp_inputs, ours, prompt_ids,
                                                      save_model_folder)
from benchmarks.harness import emit, offline_environment, peer_python, run_module
from gradpatch.dictionaries import (CLTConfig, CrossLayerTranscoder, export_circuit_tracer_clt,
                                    load_circuit_tracer_clt)

SIDE = "benchmarks.peers.circuit_tracer.clt_graphs_side"


def make_clt(model: Any, ids: torch.Tensor, latents: int, activation: str, k: int,
             nodes: tuple[str, str]) -> CrossLayerTranscoder:
    """The random CLT over every layer (module docstring)."""
    n_layers, d_model = model.config.num_hidden_layers, model.config.hidden_size
    config = CLTConfig(activation, n_layers, d_model, latents,
                       input_nodes=[nodes[0].format(layer=layer) for layer in range(n_layers)],
                       output_nodes=[nodes[1].format(layer=layer) for layer in range(n_layers)])
    generator = torch.Generator().manual_seed(0)
    clt = CrossLayerTranscoder(config, generator=generator)
    with torch.no_grad():
        clt.b_enc.fill_(0.01)
        clt.b_dec.normal_(0, 0.01, generator=generator)
        if activation == "jumprelu":
            inputs = mlp_inputs(model, ids)
            count = k * (ids.shape[1] - 1)
            for layer in range(n_layers):
                pre = clt.pre_activations(layer, inputs[layer][1:]).flatten().sort(descending=True).values
                clt.threshold[layer] = float(pre[count - 1] + pre[count]) / 2
    return clt


def prepare(args: argparse.Namespace, folder: Path) -> None:
    """The shared inputs: the model folder, the exported CLT (``folder/clt``) and ``prompt.json``."""
    model, tokenizer = build_model(args.model)
    ids = prompt_ids(args.model, tokenizer, args.tokens)
    clt = make_clt(model, ids, args.latents, args.activation, args.k, NODES[args.model])
    export_circuit_tracer_clt(clt, folder / "clt")
    save_model_folder(model, tokenizer, folder / "model")
    (folder / "prompt.json").write_text(json.dumps({"ids": ids[0].tolist(), "batch_size": args.batch_size}))


def load_clt(folder: Path, input_node: str, output_node: str) -> CrossLayerTranscoder:
    """The exported CLT read back (``folder/clt``)."""
    return load_circuit_tracer_clt(folder / "clt", input_node, output_node)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["tiny-llama", "smollm2"], default="tiny-llama")
    parser.add_argument("--tokens", type=int, default=7)
    parser.add_argument("--latents", type=int, default=64, help="latents per CLT layer")
    parser.add_argument("--activation", choices=["relu", "jumprelu"], default="jumprelu")
    parser.add_argument("--k", type=int, default=2, help="active latents per position and layer (jumprelu)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--python", help="the Python of circuit-tracer 0.5.0's virtualenv (default: "
                                          ".peers/circuit_tracer/bin/python)")
    parser.add_argument("--backends", nargs="+", choices=["nnsight", "transformerlens"], default=["nnsight"])
    parser.add_argument("--keep", help="a folder to keep the inputs and the graphs in, reused when run again "
                                       "(default: a temporary one)")
    parser.add_argument("--ours", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.ours:
        ours(args, Path(args.ours), load_clt)
        return
    environment = offline_environment(args.threads)
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(args.keep or scratch).resolve()
        folder.mkdir(parents=True, exist_ok=True)
        if not (folder / "prompt.json").exists():
            prepare(args, folder)
        for backend in args.backends:
            if not (folder / f"circuit_tracer_run_{backend}.json").exists():
                run_module(peer_python("circuit_tracer", args.python), SIDE, ["graph", str(folder), backend],
                           env=environment)
        if not (folder / "gradpatch_run.json").exists():
            run_module(sys.executable, "benchmarks.circuits.circuit_tracer_clt_graphs", [
                "--model", args.model, "--ours", str(folder)], env=environment)
        layers = load_circuit_tracer_clt(folder / "clt", *NODES[args.model]).n_layers
        prompt = json.loads((folder / "prompt.json").read_text())
        report = {"model": args.model, "tokens": len(prompt["ids"]), "layers": layers, "latents": args.latents,
                  "activation": args.activation, "k": args.k if args.activation == "jumprelu" else None,
                  "batch_size": prompt["batch_size"], "threads": args.threads,
                  "gradpatch": json.loads((folder / "gradpatch_run.json").read_text()),
                  **{f"circuit_tracer_{backend}": compare(folder, layers, backend) for backend in args.backends}}
    for backend in args.backends:
        side = report[f"circuit_tracer_{backend}"]
        side["adjacency_max_diff_of_max_abs"] = side["adjacency_max_abs_diff"] / max(side["adjacency_max_abs"], 1e-30)
    emit(report, indent=1)


if __name__ == "__main__":
    main()
