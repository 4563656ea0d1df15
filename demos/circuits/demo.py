"""The circuit demo (``make demo-circuits``): skip transcoders trained at all 30 MLPs of the embedded SmolLM2-135M by
gradpatch's own recipe, then three prompts traced with them.

Steps (each timed; the timings go to ``<out>/summary.json``):

1. the transcoders: trained by ``gradpatch fit --config recipes/configs/transcoders_smollm2.yaml`` (one Lightning run,
   one forward pass of the frozen model feeding all 30) with ``--tokens`` training tokens, or reused from the cache
   (``$GRADPATCH_CIRCUITS_DIR`` or ``~/.cache/gradpatch/circuits/<config digest>-<tokens>``, written whole by a rename
   so an interrupted run leaves nothing half-written); their held-out metrics (FVU, L0, dead fraction, CE loss
   recovered per layer and with all 30 spliced) are printed;
2. for each prompt (a two-hop fact, an IOI sentence, an addition): its attribution graph, replacement and completeness
   scores, its top features with their top activating snippets from the corpus (documents the training did not
   read; one pass over them for every feature node of the three graphs) and the tokens they promote, and ablations
   of the features the graph says carry the answer (:mod:`demos.circuits.pipeline`), written to ``<out>/<name>/``
   (graph.json, graph.html, TensorBoard).

Run::

    .venv/bin/python -m demos.circuits.demo                    # CPU; the first run trains (see README.md)
    .venv/bin/python -m demos.circuits.demo --tokens 2000000 --device cuda
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from gradpatch import PatchableGraph
from gradpatch.circuits import load_transcoders
from gradpatch.files.atomic import atomic_write_text
from gradpatch.files.cache import cache_folder
from gradpatch.files.loaders import default_device, load_model
from gradpatch.circuits import with_special_first
from recipes.dictionary.corpus import read_documents

from .pipeline import PromptReport, graph_snippets, report_prompt, trace_graph

__all__ = ["PROMPTS", "main", "trained_transcoders"]

CONFIG = Path(__file__).resolve().parents[2] / "recipes" / "configs" / "transcoders_smollm2.yaml"
#: (name, prompt): a two-hop fact, an IOI-style sentence and a small addition.
PROMPTS = [("two_hop", "Fact: the capital of the state containing Dallas is"),
           ("ioi", "When Mary and John went to the store, John gave a drink to"),
           ("addition", "Question: 3 + 5 = ? Answer: 3 + 5 =")]
#: Documents at the end of the corpus (the offline Wikipedia summaries) that the snippets are read from: the training
#: reads the corpus from its start and stops long before them.
SNIPPET_DOCUMENTS = 400


def trained_transcoders(tokens: int, device: str, cache: Path | None = None) -> tuple[Path, float]:
    """The folder of transcoders trained on ``tokens`` tokens (trained now unless cached) and the seconds spent.

    Raises:
        SystemExit: the training failed (its exit status).
    """
    digest = hashlib.sha256(CONFIG.read_bytes()).hexdigest()[:12]
    folder = (cache or cache_folder("GRADPATCH_CIRCUITS_DIR", "circuits")) / f"{digest}-{tokens}"
    if (folder / "metrics.json").is_file():
        return folder, 0.0
    staging = folder.with_name(folder.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    command = [sys.executable, "-m", "recipes.cli", "fit", "--config", str(CONFIG), "--trainer.default_root_dir",
               str(staging), "--data.train_tokens", str(tokens),
               "--trainer.accelerator", "gpu" if device.startswith("cuda") else "cpu"]
    status = subprocess.run(command, check=False).returncode  # gradpatch fit, as a user runs it
    if status != 0:
        raise SystemExit(status)
    staging.rename(folder)
    return folder, time.perf_counter() - start


def _print_report(report: PromptReport) -> None:
    print(f"\n== {report.name}: {report.prompt!r} -> {report.answer!r} (p={report.answer_probability:.3f})")
    print(f"   {report.n_features} of {report.total_features} active features; replacement score "
          f"{report.replacement_score:.3f}, completeness score {report.completeness_score:.3f}")
    for feature in report.features:
        print(f"   {feature.label}: a={feature.activation:.3g}, influence {feature.influence:.3g}; promotes "
              f"{feature.promotes}")
        for snippet in feature.snippets[:2]:
            print(f"      {snippet!r}")
    for ablation in report.ablations:
        names = ", ".join(f"L{layer} F{feature} @{position}" for layer, position, feature in ablation.features)
        print(f"   ablate {names}: edge {sum(ablation.edges):+.3g}, answer logit change {ablation.change:+.3g} "
              f"({'agrees' if ablation.agrees else 'DISAGREES'}); top after {ablation.top_after}")


def main(argv: list[str] | None = None) -> int:
    """Run the demo (module docstring); returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="runs/circuits_demo", help="output folder (default %(default)s)")
    parser.add_argument("--tokens", type=int, default=40960,
                        help="training tokens (default %(default)s: a smoke budget for a 2-core CPU; see README.md)")
    parser.add_argument("--max-feature-nodes", type=int, default=2000, help="features per graph at most")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    args = parser.parse_args(argv)
    device = args.device or default_device()
    out = Path(args.out)
    timings: dict[str, float] = {}
    folder, timings["train_s"] = trained_transcoders(args.tokens, device)
    metrics = json.loads((folder / "metrics.json").read_text(encoding="utf-8"))
    print(f"transcoders: {folder} ({'trained in %.0f s' % timings['train_s'] if timings['train_s'] else 'cached'})")
    print(json.dumps(metrics.get("all_spliced", {}), indent=1))
    start = time.perf_counter()
    model, tokenizer = load_model(None, device=device)
    transcoders = {layer: t.to(device) for layer, t in load_transcoders(folder, model).items()}
    documents = [torch.tensor(tokenizer(text).input_ids[:128]) for text in read_documents(None)[-SNIPPET_DOCUMENTS:]]
    timings["load_s"] = time.perf_counter() - start
    decode = lambda token: tokenizer.decode([token])  # noqa: E731
    traced = []
    pg = None
    for name, prompt in PROMPTS:
        start = time.perf_counter()
        ids = with_special_first(tokenizer(prompt, return_tensors="pt").input_ids.to(device), tokenizer)
        if pg is None:
            with torch.no_grad():
                pg = PatchableGraph(model, ids[:, :2], use_cache=False).eval()
        traced.append(trace_graph(pg, transcoders, ids, name=name, prompt=prompt,
                                  max_feature_nodes=args.max_feature_nodes))
        timings[f"{name}_graph_s"] = time.perf_counter() - start
    start = time.perf_counter()
    snippets = graph_snippets(pg, transcoders, traced, documents, decode)
    timings["snippets_s"] = time.perf_counter() - start
    reports = []
    for prompt_graph in traced:
        start = time.perf_counter()
        report = report_prompt(pg, transcoders, prompt_graph, snippets=snippets, decode=decode,
                               out=out / prompt_graph.name)
        timings[f"{prompt_graph.name}_report_s"] = time.perf_counter() - start
        _print_report(report)
        reports.append(report)
    summary: dict[str, Any] = {"command": sys.argv, "transcoders": str(folder), "tokens": args.tokens,
                               "metrics": metrics, "prompts": [r.to_dict() for r in reports], "timings": timings}
    atomic_write_text(out / "summary.json", json.dumps(summary, indent=1))
    print(f"\nwrote {out}/<prompt>/graph.html and {out / 'summary.json'}; timings {timings}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
