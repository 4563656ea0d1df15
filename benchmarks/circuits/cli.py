"""``gradpatch circuit`` end to end on the embedded SmolLM2-135M; prints JSON.

Random TopK skip transcoders (1,024 latents, k = ``--k``; no trained transcoders for SmolLM2 are installed here) are
saved with ``save_dictionary`` (the model's fingerprint recorded) as ``layer_<i>/`` folders for ``--layers``; then
``gradpatch circuit`` runs on ``--prompt`` with the default model, an ``--intervene`` ablation of the most active
feature of the last listed layer at the last position and a steer, and the files it wrote are measured: the seconds
of the command (including loading the model), the graph's features and nodes, the pruned graph's nodes and links,
the bytes of each file, the HTML's external references (none expected), whether every graph.json node's label is on
the page, and the top logits before and after the intervention.

Run: ``OMP_NUM_THREADS=2 .venv/bin/python -m benchmarks.circuits.cli --layers 0,10,20,29 --k 4 --device cpu``
"""

from __future__ import annotations

import argparse
import json
import re
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.harness import emit
from gradpatch import PatchableGraph
from gradpatch.circuits import node_label
from gradpatch.dictionaries import SkipTranscoder, save_dictionary
from gradpatch.files.loaders import load_embedded_model
from gradpatch.patches import ProbePatch
from recipes import cli

PROMPT = "The capital of France is Paris. The capital of Italy is"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", default="0,10,20,29")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--prompt", default=PROMPT)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--out", default=None, help="keep the command's output folder here (default: a temporary one)")
    args = parser.parse_args()
    layers = [int(layer) for layer in args.layers.split(",")]
    model, tokenizer = load_embedded_model()
    ids = tokenizer(args.prompt, return_tensors="pt").input_ids
    generator = torch.Generator().manual_seed(0)
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        transcoders = {}
        for layer in layers:
            transcoders[layer] = SkipTranscoder(576, 1024, activation="topk", k=args.k, generator=generator,
                                                input_node=f"model.layers_{layer}.mlp.x",
                                                output_node=f"model.layers_{layer}.mlp.output")
            save_dictionary(transcoders[layer], root / "dictionaries" / f"layer_{layer}", model=model)
        last = layers[-1]
        probe = ProbePatch()
        pg = PatchableGraph(model, ids, use_cache=False)
        with torch.no_grad(), pg.patch({f"model.layers_{last}.mlp.x": [probe]}):
            pg(ids)
        feature = int(transcoders[last].encode(probe.activation)[0, -1].argmax())
        edits = [f"ablate:{last}:-1:{feature}", f"steer:{layers[0]}:-1:{feature}=8.0"]
        out = Path(args.out) if args.out else root / "out"
        start = time.perf_counter()
        status = cli.main(["circuit", "--prompt", args.prompt, "--dictionaries", str(root / "dictionaries"),
                           "--device", args.device, "--batch-size", str(args.batch_size), "--out", str(out),
                           *[f"--intervene={edit}" for edit in edits]])
        seconds = time.perf_counter() - start
        nodes = json.loads((out / "nodes.json").read_text())["nodes"]
        frontend = json.loads((out / "graph.json").read_text())
        page = (out / "graph.html").read_text()
        record = json.loads((out / "interventions.json").read_text())
        tokens = frontend["metadata"]["prompt_tokens"]
        report = {
            "status": status, "device": args.device, "layers": layers, "k": args.k, "tokens": int(ids.shape[1]),
            "seconds_command": round(seconds, 1), "features": sum(n["kind"] == "feature" for n in nodes),
            "nodes": len(nodes), "pruned_nodes": len(frontend["nodes"]), "pruned_links": len(frontend["links"]),
            "bytes": {p.name: p.stat().st_size for p in sorted(out.iterdir()) if p.is_file()},
            "html_external_references": len(re.findall(r"https?://|\bsrc=|<link", page)),
            "html_has_every_label": all(node_label(n, tokens) in page.replace("&quot;", '"').replace("&#x27;", "'")
                                        for n in frontend["nodes"]),
            "edits": record["edits"],
            "top_before": [(t["text"], round(t["probability"], 4)) for t in record["top_before"][:5]],
            "top_after": [(t["text"], round(t["probability"], 4)) for t in record["top_after"][:5]],
        }
    emit(report, device=args.device, indent=1)


if __name__ == "__main__":
    main()
