"""CPU seconds and peak memory of gradpatch's ``attribute`` beside circuit-tracer 0.5.0's, on the same random
transcoders and prompts, and of a whole command over several prompts (imports included); prints JSON.

The inputs are benchmarks/circuits/circuit_tracer_graphs.py's (``--model smollm2``): the embedded SmolLM2-135M in
float32, ReLU skip transcoders with 1,024 random latents at all 30 MLPs (about ``--k`` active per position), the BOS
token and the first ``tokens`` − 1 tokens of a fixed text, exported in circuit-tracer's layout. For each prompt
length, each side runs in its own process with one thread (``OMP_NUM_THREADS=1``, so ``torch.get_num_threads()``
is 1; recorded), the sides interleaved ``--repeats`` times (gradpatch, then each circuit-tracer backend, then again):

- ``attribute``: the CPU seconds (``time.process_time``) of gradpatch's ``attribute(ReplacementModel(...))`` (its
  first call, graphs of batched calls extracted inside it) and of circuit-tracer's ``attribute`` (its
  ``setup_attribution`` forward pass inside it), the peak resident memory of each process during it, and
  gradpatch's ``ReplacementModel`` construction (a forward pass of the prompt with the transcoders spliced, which
  circuit-tracer's ``attribute`` does inside);
- the graphs compared node by node (circuit_tracer_graphs.compare): the largest |A_gradpatch − A_circuit-tracer|,
  the largest |A| and whether the difference is within 1e-4;
- a whole command: ``gradpatch circuit --prompts FILE`` (model and transcoders loaded once, every graph pruned and
  written with its HTML page) and one circuit-tracer process that imports it, loads the same model and transcoders
  and runs ``attribute`` and ``create_graph_files`` (its pruning and graph JSON) for each prompt: each process's
  user + system CPU seconds, wall seconds and peak resident memory (``os.wait4``'s ``ru_maxrss``).

The CPU of this machine may be shared with other work: CPU seconds are less affected than wall seconds, and the
1-minute load average is recorded beside each run. Ratios are gradpatch / circuit-tracer (below 1: gradpatch
uses less).

Run: ``.venv/bin/python -m benchmarks.circuits.attribute_speed --tokens 16 64 --repeats 2 --prompts 3``
(``--backends nnsight transformerlens``; circuit-tracer 0.5.0 from ``.peers/circuit_tracer``, ``make peers``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.harness import ROOT, emit, offline_environment, peer_python, run_module

GRAPHS = "benchmarks.circuits.circuit_tracer_graphs"
SIDE = "benchmarks.peers.circuit_tracer.graphs_side"
#: The whole command's prompts (about 12 tokens each with the BOS token).
PROMPTS = ["The capital of France is Paris. The capital of Italy is",
           "The capital of Spain is Madrid. The capital of Germany is",
           "The capital of Japan is Tokyo. The capital of China is",
           "The capital of Egypt is Cairo. The capital of Kenya is"]


def _environment() -> dict[str, str]:
    return {**offline_environment(1), "PYTHONPATH": str(ROOT)}


def _measured(command: list[str]) -> dict[str, Any]:
    """Run ``command`` from the repository's root; its CPU seconds (user + system), wall seconds and peak resident
    memory, from ``os.wait4``.

    Raises:
        SystemExit: the command failed (its output's tail is written to stderr first).
    """
    load = os.getloadavg()[0]
    start = time.perf_counter()
    process = subprocess.Popen(command, cwd=ROOT, env=_environment(), stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    output = process.stdout.read() if process.stdout else ""
    _, status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode:
        sys.stderr.write(output[-6000:])
        raise SystemExit(f"{' '.join(command[:4])} failed with exit status {process.returncode}")
    return {"cpu_seconds": round(usage.ru_utime + usage.ru_stime, 2),
            "wall_seconds": round(time.perf_counter() - start, 2),
            "peak_rss_gib": round(usage.ru_maxrss / 2**20, 3),
            "load_average_1min": [round(load, 1), round(os.getloadavg()[0], 1)]}


def _prepare(folder: Path, tokens: int, k: int, batch_size: int) -> None:
    from benchmarks.circuits.circuit_tracer_graphs import prepare

    prepare(argparse.Namespace(model="smollm2", tokens=tokens, k=k, batch_size=batch_size), folder)


def _attribute_runs(folder: Path, backends: list[str], repeats: int) -> dict[str, list[dict[str, Any]]]:
    """Each side's run records, the sides interleaved ``repeats`` times."""
    runs: dict[str, list[dict[str, Any]]] = {"gradpatch": [], **{backend: [] for backend in backends}}
    for _ in range(repeats):
        run_module(sys.executable, GRAPHS, ["--model", "smollm2", "--ours", str(folder)], env=_environment())
        runs["gradpatch"].append(json.loads((folder / "gradpatch_run.json").read_text()))
        for backend in backends:
            run_module(peer_python("circuit_tracer"), SIDE, ["graph", str(folder), backend], env=_environment())
            runs[backend].append(json.loads((folder / f"circuit_tracer_run_{backend}.json").read_text()))
    return runs


def _attribute_report(folder: Path, backends: list[str], repeats: int) -> dict[str, Any]:
    from benchmarks.circuits.circuit_tracer_graphs import compare

    runs = _attribute_runs(folder, backends, repeats)
    ours = min(run["attribute_cpu_seconds"] for run in runs["gradpatch"])
    report: dict[str, Any] = {"tokens": len(json.loads((folder / "prompt.json").read_text())["ids"]),
                              "gradpatch_runs": runs["gradpatch"],
                              "gradpatch_attribute_cpu_seconds_min": ours}
    peers = {}
    for backend in backends:
        comparison = compare(folder, 30, backend)
        theirs = min(run["attribute_cpu_seconds"] for run in runs[backend])
        peers[backend] = theirs
        report[f"circuit_tracer_{backend}"] = {
            "runs": runs[backend], "attribute_cpu_seconds_min": theirs,
            "cpu_ratio_gradpatch_over_circuit_tracer": round(ours / theirs, 3),
            "peak_rss_ratio": round(min(r["max_rss_gib"] for r in runs["gradpatch"])
                                    / min(r["max_rss_gib"] for r in runs[backend]), 3),
            "feature_sets_equal": comparison["feature_sets_equal"],
            "logits_equal": comparison["logits_gradpatch"] == comparison["logits_circuit_tracer"],
            "adjacency_max_abs_diff": comparison["adjacency_max_abs_diff"],
            "adjacency_max_abs": comparison["adjacency_max_abs"],
            "graphs_equal_within_1e-4": (comparison["feature_sets_equal"]
                                         and comparison["adjacency_max_abs_diff"] <= 1e-4)}
    fastest = min(peers, key=peers.get)
    report["fastest_circuit_tracer_backend"] = fastest
    report["cpu_ratio_to_fastest"] = round(ours / peers[fastest], 3)
    return report


def _command_report(folder: Path, scratch: Path, backend: str, prompts: list[str], batch_size: int,
                    repeats: int) -> dict[str, Any]:
    """The whole command for ``prompts`` on each side, interleaved ``repeats`` times."""
    prompt_file = scratch / "prompts.txt"
    prompt_file.write_text("\n".join(prompts) + "\n")
    ours_command = [sys.executable, "-m", "recipes.cli", "circuit", "--prompts", str(prompt_file), "--dictionaries",
                    str(folder / "transcoders"), "--batch-size", str(batch_size), "--quiet", "--out"]
    theirs_command = [peer_python("circuit_tracer"), "-m", "benchmarks.circuits.attribute_speed", "--peer-command",
                      str(folder), backend, str(prompt_file), str(batch_size), "--out"]
    runs: dict[str, list[dict[str, Any]]] = {"gradpatch": [], "circuit_tracer": []}
    for repeat in range(repeats):
        runs["gradpatch"].append(_measured([*ours_command, str(scratch / f"ours_{repeat}")]))
        runs["circuit_tracer"].append(_measured([*theirs_command, str(scratch / f"theirs_{repeat}")]))
    best = {side: min(run["cpu_seconds"] for run in side_runs) for side, side_runs in runs.items()}
    return {"prompts": len(prompts), "circuit_tracer_backend": backend, "batch_size": batch_size,
            "gradpatch_command": "gradpatch circuit --prompts FILE (pruned graphs, graph.json, graph.html)",
            "circuit_tracer_command": "import, load, then attribute + create_graph_files per prompt",
            "runs": runs, "cpu_seconds_min": best,
            "cpu_ratio_gradpatch_over_circuit_tracer": round(best["gradpatch"] / best["circuit_tracer"], 3),
            "peak_rss_gib_min": {side: min(run["peak_rss_gib"] for run in side_runs)
                                 for side, side_runs in runs.items()}}


def peer_command(folder: Path, backend: str, prompt_file: Path, batch_size: int, out: Path) -> None:
    """circuit-tracer's whole command (run in its virtualenv): load the replacement model of ``folder``, then for
    each line of ``prompt_file`` its ``attribute`` and ``create_graph_files`` into ``out``."""
    from circuit_tracer import attribute
    from circuit_tracer.utils.create_graph_files import create_graph_files

    from benchmarks.peers.circuit_tracer.graphs_side import replacement_model

    model = replacement_model(folder, backend)
    out.mkdir(parents=True, exist_ok=True)
    for index, prompt in enumerate(prompt_file.read_text().splitlines()):
        graph = attribute(prompt, model, batch_size=batch_size, max_feature_nodes=7500)
        graph.cfg.tokenizer_name = str(folder / "model")  # create_graph_files loads the tokenizer by this name
        create_graph_files(graph, f"prompt-{index}", str(out), node_threshold=0.8, edge_threshold=0.98)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--k", type=int, default=2, help="active latents per position")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=3, help="prompts of the whole command (0: none)")
    parser.add_argument("--backends", nargs="+", choices=["nnsight", "transformerlens"],
                        default=["nnsight", "transformerlens"])
    parser.add_argument("--peer-command", nargs=4, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.peer_command:
        folder, backend, prompt_file, batch_size = args.peer_command
        peer_command(Path(folder), backend, Path(prompt_file), int(batch_size), Path(args.out))
        return
    report: dict[str, Any] = {"threads": 1, "cpu_shared": "the machine's CPU may be shared with other work",
                              "batch_size": args.batch_size, "k": args.k, "repeats": args.repeats}
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        for tokens in args.tokens:
            folder = root / f"tokens_{tokens}"
            _prepare(folder, tokens, args.k, args.batch_size)
            report[f"attribute_{tokens}_tokens"] = _attribute_report(folder, args.backends, args.repeats)
        if args.prompts:
            folder = root / f"tokens_{args.tokens[0]}"
            fastest = report[f"attribute_{args.tokens[0]}_tokens"]["fastest_circuit_tracer_backend"]
            prompts = (PROMPTS * args.prompts)[:args.prompts]
            report["whole_command"] = _command_report(folder, root, fastest, prompts, args.batch_size, args.repeats)
    report["cpu_ratios"] = {key: value["cpu_ratio_to_fastest"] for key, value in report.items()
                            if key.startswith("attribute_")}
    report["median_gradpatch_attribute_cpu_seconds"] = {
        key: statistics.median(run["attribute_cpu_seconds"] for run in value["gradpatch_runs"])
        for key, value in report.items() if key.startswith("attribute_")}
    emit(report, indent=1)


if __name__ == "__main__":
    main()
