"""Attribution graphs side by side with circuit-tracer: the same model, transcoders and prompt; the active feature
nodes, the logit nodes and the adjacency matrices compared, and each side's time and peak memory; prints JSON.

Models: ``tiny-llama`` / ``tiny-gpt2`` (the test suite's 2-layer models, d_model 64; the BOS token and 6 random ids;
ReLU skip transcoders with 64 latents as tests/circuits/test_circuits.py builds them) or ``smollm2`` (the embedded
SmolLM2-135M, 30 layers; the BOS token and the first ``--tokens`` − 1 tokens of a fixed text, repeated; ReLU skip
transcoders with 1,024 random latents at every MLP, each layer's encoder bias set so that about ``--k`` latents are
active per position on the prompt). The transcoders are exported with
:func:`gradpatch.dictionaries.export_circuit_tracer`; circuit-tracer loads that set
(benchmarks/peers/circuit_tracer/graphs_side.py, in its own virtualenv: 0.5.0's ``nnsight`` or ``transformerlens``
backend, or the source at commit ``d797c82``) and gradpatch reads the same files back with
:func:`gradpatch.dictionaries.load_circuit_tracer`. Each side runs in its own process on the same number of
threads; the peak resident memory is that process's.

The graphs are compared on circuit-tracer's node order, which gradpatch's follows. circuit-tracer zeroes every
activation and the error vector at position 0 (0.5.0: ``zero_positions = slice(0, 1)``, after prepending a special
token to a prompt that lacks one; d797c82: when the first token is a special token), so its graph has no
position-0 feature nodes and its position-0 error nodes have zero edges. gradpatch's ``attribute`` does the same
by default (``zero_first_position``), and the whole matrices are compared; with ``--keep-first-position`` it keeps
position 0's nodes and the comparison is on the common nodes (features and errors at positions ≥ 1, every token and
logit node). Targets are the common feature and logit rows, sources the common feature, error and token columns.
Reported per circuit-tracer side: the feature sets (equal outright, and equal at positions ≥ 1), the logit nodes,
max |A_gradpatch − A_circuit-tracer| over the compared block, the largest |A| there, the number of entries
differing by more than 1e-4, the worst and median row's max |diff| / max |row|, and the largest |A| of each graph
outside the block.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.circuits.circuit_tracer_graphs --model tiny-llama``
(``--model tiny-gpt2``; ``--model smollm2 --tokens 16 --k 2 --batch-size 64``). circuit-tracer 0.5.0 runs from
``.peers/circuit_tracer`` and d797c82 from ``.peers/circuit_tracer_d797c82`` (``make peers``); options name others.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from benchmarks.harness import (emit, max_rss_mib, offline_environment, peak_mib, peer_python, reset_peak,
                                resident_mib, run_module)
from gradpatch import PatchableGraph
from gradpatch.circuits import ReplacementModel, attribute
from gradpatch.dictionaries import SkipTranscoder, export_circuit_tracer, load_circuit_tracer

SIDE = "benchmarks.peers.circuit_tracer.graphs_side"
PROMPT = "The capital of France is Paris. The capital of Italy is Rome. The capital of Spain is Madrid. The capital of"
#: model -> the NodePaths each layer's transcoder reads (the MLP input) and writes (the MLP output).
NODES = {"tiny-llama": ("model.layers_{layer}.mlp.x", "model.layers_{layer}.mlp.output"),
         "smollm2": ("model.layers_{layer}.mlp.x", "model.layers_{layer}.mlp.output"),
         "tiny-gpt2": ("transformer.h_{layer}.mlp.hidden_states", "transformer.h_{layer}.mlp.output")}


def build_model(name: str) -> tuple[Any, Any]:
    """``(model, tokenizer)``: the seeded tiny Llama or GPT-2 with SmolLM2's tokenizer, or the embedded SmolLM2
    (float32)."""
    from transformers import AutoTokenizer

    from gradpatch.files.loaders import embedded_model_path, load_embedded_model

    if name == "smollm2":
        return load_embedded_model()
    from gradpatch.testing import tiny_gpt2, tiny_llama

    path = embedded_model_path()
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    if name == "tiny-gpt2":
        return tiny_gpt2(100, hidden=64, init_std=0.02, n_positions=128), tokenizer
    model = tiny_llama(100, hidden=64, intermediate=128, init_std=0.02, max_position_embeddings=128,
                       pad_token_id=None, bos_token_id=1, eos_token_id=2)
    return model, tokenizer


def mlp_inputs(model: Any, ids: torch.Tensor) -> list[torch.Tensor]:
    """Each layer's MLP input on the prompt ``[seq, d_model]``."""
    inputs: list[torch.Tensor] = []
    handles = [layer.mlp.register_forward_pre_hook(lambda _m, args: inputs.append(args[0][0].detach()))
               for layer in model.model.layers]
    with torch.no_grad():
        model(ids)
    for handle in handles:
        handle.remove()
    return inputs


def make_transcoders(model: Any, ids: torch.Tensor, latents: int, k: int, nodes: tuple[str, str]
                     ) -> dict[int, SkipTranscoder]:
    """Random ReLU skip transcoders at every MLP (seed 0); with ``k`` > 0 each layer's b_enc is lowered by the
    midpoint between the (k·seq)-th and the next largest of its pre-activations on the prompt, so about k latents
    are active per position and no pre-activation lies within rounding of 0 (where the two sides' float32 sums
    could disagree on whether a feature is active)."""
    generator = torch.Generator().manual_seed(0)
    d_model = model.config.hidden_size
    inputs = mlp_inputs(model, ids) if k else []
    transcoders = {}
    for layer in range(model.config.num_hidden_layers):
        transcoder = SkipTranscoder(d_model, latents, activation="relu", input_node=nodes[0].format(layer=layer),
                                    output_node=nodes[1].format(layer=layer), generator=generator)
        with torch.no_grad():
            transcoder.W_skip.normal_(0, 0.05 if not k else 0.02, generator=generator)
            transcoder.b_dec.normal_(0, 0.01, generator=generator)
            if k:
                pre = transcoder.pre_activations(inputs[layer]).flatten().sort(descending=True).values
                count = k * inputs[layer].shape[0]
                transcoder.b_enc.sub_(float(pre[count - 1] + pre[count]) / 2)
        transcoders[layer] = transcoder
    return transcoders


def save_model_folder(model: Any, tokenizer: Any, folder: Path) -> None:
    """The model as a Hugging Face folder that transformers 4.57 reads: ``config.json`` (with ``rope_theta``),
    ``model.safetensors`` (float32) and the tokenizer's files (``tokenizer.json``, read as a
    ``PreTrainedTokenizerFast``)."""
    folder.mkdir(parents=True)
    config = model.config.to_dict()
    rope = config.pop("rope_parameters", None) or {}
    if config["model_type"] == "llama":
        config["rope_theta"] = float(config.get("rope_theta") or rope.get("rope_theta", 10000.0))
    config.update(architectures=[type(model).__name__], torch_dtype="float32", dtype="float32")
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    state = {name: tensor.detach().clone().contiguous() for name, tensor in model.state_dict().items()}
    if config.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)
    save_file(state, str(folder / "model.safetensors"))
    tokenizer.save_pretrained(str(folder))
    settings = json.loads((folder / "tokenizer_config.json").read_text())  # transformers 5 names its own class
    settings["tokenizer_class"] = "PreTrainedTokenizerFast"
    (folder / "tokenizer_config.json").write_text(json.dumps(settings, indent=1))


def prompt_ids(name: str, tokenizer: Any, tokens: int) -> torch.Tensor:
    """The prompt ``[1, tokens]``: the BOS token, then a prefix of :data:`PROMPT` repeated (``smollm2``) or seeded
    random ids in [20, 100) (``tiny-llama``)."""
    bos = torch.tensor([[tokenizer.bos_token_id]])
    if name == "smollm2":
        text = " ".join([PROMPT] * (1 + tokens // 16))  # a prefix of it is the prompt
        return torch.cat([bos, tokenizer(text, return_tensors="pt").input_ids[:, :tokens - 1]], 1)
    generator = torch.Generator().manual_seed(3)
    return torch.cat([bos, torch.randint(20, 100, (1, tokens - 1), generator=generator)], 1)


def prepare(args: argparse.Namespace, folder: Path) -> None:
    """The shared inputs: the model folder, the exported transcoder set and ``prompt.json``."""
    model, tokenizer = build_model(args.model)
    ids = prompt_ids(args.model, tokenizer, args.tokens)
    latents, k = (1024, args.k) if args.model == "smollm2" else (64, 0)
    transcoders = make_transcoders(model, ids, latents, k, NODES[args.model])
    export_circuit_tracer(transcoders, folder / "transcoders", str(folder / "model"), "mlp.hook_in", "mlp.hook_out")
    save_model_folder(model, tokenizer, folder / "model")
    (folder / "prompt.json").write_text(json.dumps({"ids": ids[0].tolist(), "batch_size": args.batch_size}))


def ours(args: argparse.Namespace, folder: Path,
         load: Callable[[Path, str, str], Any] = lambda folder, *nodes: load_circuit_tracer(
             folder / "transcoders" / "config.yaml", *nodes)) -> None:
    """gradpatch's side (its own process): the graph of the saved prompt over the dictionaries ``load(folder,
    *NODES[model])`` reads back from the exported files (by default the transcoder set)."""
    prompt = json.loads((folder / "prompt.json").read_text())
    start = time.perf_counter()
    model, _ = build_model(args.model)
    ids = torch.tensor([prompt["ids"]])
    dictionaries = load(folder, *NODES[args.model])
    pg_cpu = time.process_time()
    pg = PatchableGraph(model, ids, use_cache=False)
    replacement_cpu = time.process_time()
    replacement = ReplacementModel(pg, dictionaries, ids)
    pg_cpu, replacement_cpu = replacement_cpu - pg_cpu, time.process_time() - replacement_cpu
    loaded = time.perf_counter() - start
    rss_loaded = resident_mib() / 1024
    reset_peak()
    zero_first = not getattr(args, "keep_first_position", False)
    start, cpu, load_average = time.perf_counter(), time.process_time(), os.getloadavg()[0]
    graph = attribute(replacement, max_feature_nodes=None, batch_size=prompt["batch_size"],
                      zero_first_position=zero_first)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    save_file({"adjacency": graph.adjacency.contiguous(), "active_features": graph.active_features.contiguous(),
               "activation_values": graph.activations.contiguous(), "logit_tokens": graph.logit_tokens.contiguous(),
               "logit_probabilities": graph.logit_probabilities.contiguous()},
              str(folder / "gradpatch_graph.safetensors"))
    (folder / "gradpatch_run.json").write_text(json.dumps({
        "load_seconds": round(loaded, 2), "patchable_graph_cpu_seconds": round(pg_cpu, 2),
        "replacement_model_cpu_seconds": round(replacement_cpu, 2), "attribute_seconds": round(seconds, 2),
        "attribute_cpu_seconds": round(cpu, 2),
        "load_average_1min": [round(load_average, 1), round(os.getloadavg()[0], 1)],
        "rss_after_load_gib": round(rss_loaded, 3), "peak_rss_during_attribute_gib": round(peak_mib() / 1024, 3),
        "max_rss_gib": round(max_rss_mib() / 1024, 3),
        "torch_threads": torch.get_num_threads(), "zero_first_position": zero_first}))


def _node_indices(features: torch.Tensor, layers: int, seq: int, logit_tokens: list[int],
                  common: list[tuple[int, int, int]], common_logits: list[int], first: int
                  ) -> tuple[list[int], list[int]]:
    """Indices (rows = targets, columns = sources) of the common nodes in one graph's order (error nodes from
    position ``first``)."""
    where = {tuple(f): i for i, f in enumerate(features.tolist())}
    feature_rows = [where[f] for f in common]
    start = len(features)
    errors = [start + layer * seq + position for layer in range(layers) for position in range(first, seq)]
    tokens = [start + layers * seq + position for position in range(seq)]
    logits = [start + (layers + 1) * seq + logit_tokens.index(t) for t in common_logits]
    return feature_rows + logits, feature_rows + errors + tokens


def compare(folder: Path, layers: int, backend: str) -> dict[str, Any]:
    """The two graphs compared on their common nodes (module docstring)."""
    ours_graph = load_file(str(folder / "gradpatch_graph.safetensors"))
    theirs = load_file(str(folder / f"circuit_tracer_graph_{backend}.safetensors"))
    seq = len(json.loads((folder / "prompt.json").read_text())["ids"])
    ours_features = {tuple(f) for f in ours_graph["active_features"].tolist()}
    their_features = {tuple(f) for f in theirs["active_features"].tolist()}
    ours_after_0 = {f for f in ours_features if f[1] > 0}
    zeroed = json.loads((folder / "gradpatch_run.json").read_text())["zero_first_position"]
    common = sorted(ours_features & their_features)
    our_logits, their_logits = ours_graph["logit_tokens"].tolist(), theirs["logit_tokens"].tolist()
    common_logits = [t for t in our_logits if t in their_logits]
    probabilities = [(float(ours_graph["logit_probabilities"][our_logits.index(t)]),
                      float(theirs["logit_probabilities"][their_logits.index(t)])) for t in common_logits]
    report: dict[str, Any] = {
        "run": json.loads((folder / f"circuit_tracer_run_{backend}.json").read_text()),
        "features_gradpatch": len(ours_features),
        "features_gradpatch_at_position_0": len(ours_features) - len(ours_after_0),
        "features_circuit_tracer": len(their_features),
        "feature_sets_equal": ours_features == their_features,
        "feature_sets_equal_after_position_0": ours_after_0 == their_features,
        "features_only_gradpatch": len(ours_after_0 - their_features),
        "features_only_circuit_tracer": len(their_features - ours_after_0),
        "logits_gradpatch": our_logits, "logits_circuit_tracer": their_logits,
        "logit_probability_max_abs_diff": max((abs(a - b) for a, b in probabilities), default=None)}
    first = 0 if zeroed else 1  # position 0's error nodes compared where both graphs zero them
    our_rows, our_cols = _node_indices(ours_graph["active_features"], layers, seq, our_logits, common, common_logits,
                                       first)
    their_rows, their_cols = _node_indices(theirs["active_features"], layers, seq, their_logits, common,
                                           common_logits, first)
    a = ours_graph["adjacency"][our_rows][:, our_cols].double()
    b = theirs["adjacency"][their_rows][:, their_cols].double()
    diff = (a - b).abs()
    row_scale = a.abs().amax(1).clamp_min(1e-30)
    activations_diff = (ours_graph["activation_values"][our_rows[:len(common)]]
                        - theirs["activation_values"][their_rows[:len(common)]]).abs()
    their_rest, our_rest = theirs["adjacency"].clone(), ours_graph["adjacency"].clone()
    their_rest[torch.tensor(their_rows)[:, None], torch.tensor(their_cols)[None, :]] = 0
    our_rest[torch.tensor(our_rows)[:, None], torch.tensor(our_cols)[None, :]] = 0
    report.update({
        "compared_block": list(a.shape), "shapes": [list(ours_graph["adjacency"].shape),
                                                    list(theirs["adjacency"].shape)],
        "activation_max_abs_diff": float(activations_diff.max()) if len(common) else 0.0,
        "adjacency_max_abs_diff": float(diff.max()), "adjacency_max_abs": float(a.abs().max()),
        "entries_diff_gt_1e-4": int((diff > 1e-4).sum()), "entries_nonzero": int((a != 0).sum()),
        "worst_row_max_diff_of_row_max": float((diff.amax(1) / row_scale).max()),
        "median_row_max_diff_of_row_max": float((diff.amax(1) / row_scale).median()),
        "logit_rows_max_abs_diff": float(diff[len(common):].max()),
        "circuit_tracer_max_abs_outside_block": float(their_rest.abs().max()),
        "gradpatch_max_abs_outside_block": float(our_rest.abs().max())})
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(NODES), default="tiny-llama")
    parser.add_argument("--tokens", type=int, default=7)
    parser.add_argument("--k", type=int, default=2, help="active latents per position (smollm2)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--python", help="the Python of circuit-tracer 0.5.0's virtualenv (default: "
                                          ".peers/circuit_tracer/bin/python)")
    parser.add_argument("--python-d797c82", help="the Python of circuit-tracer d797c82's virtualenv (default: "
                                                  ".peers/circuit_tracer_d797c82/bin/python)")
    parser.add_argument("--source-d797c82", help="circuit-tracer's source folder at d797c82 (holding "
                                                  "circuit_tracer/), put on the PYTHONPATH (default: none)")
    parser.add_argument("--backends", nargs="+", choices=["nnsight", "transformerlens", "d797c82"],
                        help="circuit-tracer's backends to run (default: all three; for tiny-gpt2 only "
                             "transformerlens: 0.5.0's nnsight backend has no GPT-2 mapping and d797c82 reads "
                             "rotary buffers that GPT-2's attention lacks)")
    parser.add_argument("--keep", help="a folder to keep the inputs and the graphs in, reused when run again "
                                       "(default: a temporary one)")
    parser.add_argument("--keep-first-position", action="store_true",
                        help="gradpatch keeps position 0's features and errors as nodes (default: circuit-tracer's "
                             "convention, attribute's zero_first_position)")
    parser.add_argument("--ours", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.backends = args.backends or (["transformerlens"] if args.model == "tiny-gpt2"
                                      else ["nnsight", "transformerlens", "d797c82"])
    if args.ours:
        ours(args, Path(args.ours))
        return
    environment = offline_environment(args.threads)
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(args.keep or scratch).resolve()
        folder.mkdir(parents=True, exist_ok=True)
        if not (folder / "prompt.json").exists():  # a kept folder's inputs and graphs are reused
            prepare(args, folder)
        for backend in args.backends:
            if not (folder / f"circuit_tracer_run_{backend}.json").exists():
                python, path = ((peer_python("circuit_tracer_d797c82", args.python_d797c82), args.source_d797c82)
                                if backend == "d797c82" else (peer_python("circuit_tracer", args.python), None))
                run_module(python, SIDE, ["graph", str(folder), backend], env=environment,
                           extra_path=[path] if path else [])
        if not (folder / "gradpatch_run.json").exists():
            run_module(sys.executable, "benchmarks.circuits.circuit_tracer_graphs", [
                "--model", args.model, "--ours", str(folder),
                *(["--keep-first-position"] if args.keep_first_position else [])], env=environment)
        layers = len(load_circuit_tracer(folder / "transcoders" / "config.yaml", *NODES[args.model]))
        prompt = json.loads((folder / "prompt.json").read_text())
        report = {"model": args.model, "tokens": len(prompt["ids"]), "layers": layers,
                  "batch_size": prompt["batch_size"], "threads": args.threads,
                  "gradpatch": json.loads((folder / "gradpatch_run.json").read_text()),
                  **{f"circuit_tracer_{backend}": compare(folder, layers, backend) for backend in args.backends}}
    emit(report, indent=1)


if __name__ == "__main__":
    main()
