"""The main job (``make demo``), until the ROME demo lands.

Loads the embedded SmolLM2-135M-Instruct, builds its PatchableGraph, prints part of the node tree, then runs an
activation-patching experiment: the residual stream at the last token of "The Colosseum is located in the city of"
(captured with a ProbePatch at ``model.layers_24.output``) is patched, through an AddPatch of the difference,
into the same position of "The Eiffel Tower is located in the city of". The prediction moves from " Paris" to
" Rome": by layer 24 the subject's location has been moved to the last token.

Run: ``.venv/bin/python -m demos.main_job`` (about a minute on 2 CPU cores, most of it loading the GGUF file).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from gradpatch import AddPatch, PatchableGraph, ProbePatch
from gradpatch.models import load_embedded_model
from recipes.cli import draw_tree

PROMPT = "The Eiffel Tower is located in the city of"
SOURCE_PROMPT = "The Colosseum is located in the city of"
LAYER = 24
NODE = f"model.layers_{LAYER}.output"  # residual stream after decoder layer 24, shape (batch, seq, 576)
TOP_LINES = 25


def _logits(out: Any) -> torch.Tensor:
    """The logits of a causal-LM output (ModelOutput, dict or tuple)."""
    if hasattr(out, "logits"):
        return out.logits
    if isinstance(out, dict):
        return out["logits"]
    return out[0]


def _top(tokenizer: Any, logits: torch.Tensor, k: int = 3) -> str:
    """Top-k next tokens of the last position with their probabilities."""
    probs = logits[0, -1].float().softmax(-1)
    top = probs.topk(k)
    return ", ".join(f"{tokenizer.decode(int(i))!r} {p:.3f}" for p, i in zip(top.values.tolist(), top.indices))


def _head(text: str, n: int) -> str:
    """The first ``n`` lines of ``text``, with a count of the rest."""
    lines = text.splitlines()
    more = f"\n... ({len(lines) - n} more lines)" if len(lines) > n else ""
    return "\n".join(lines[:n]) + more


def main() -> None:
    torch.manual_seed(0)
    t0 = time.perf_counter()
    model, tokenizer = load_embedded_model()
    t1 = time.perf_counter()
    print(f"loaded SmolLM2-135M-Instruct in {t1 - t0:.1f} s")

    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    source_ids = tokenizer(SOURCE_PROMPT, return_tensors="pt").input_ids

    t2 = time.perf_counter()
    pg = PatchableGraph(model, ids, use_cache=False)
    t3 = time.perf_counter()
    print(f"built PatchableGraph in {t3 - t2:.1f} s")

    n_lines = len(repr(pg.graph).splitlines())
    print(f"\n== pg.graph, one level (print(pg.graph) draws all {n_lines} lines) ==")
    print(draw_tree(pg.graph, 1))
    print("\n== pg.graph.model, one level ==")
    print(_head(draw_tree(pg.graph.model, 1), TOP_LINES))
    print("\n== pg.graph.model.layers_0, one level ==")
    print(draw_tree(pg.graph.model.layers_0, 1))
    print("\n== pg.graph.model.layers_0.mlp ==")
    print(repr(pg.graph.model.layers_0.mlp))

    with torch.no_grad():
        plain = _logits(model(ids, use_cache=False))
        unpatched = _logits(pg(ids, use_cache=False))
        print(f"\nmax |pg(x) - model(x)| on the logits: {(plain - unpatched).abs().max().item():.3g}")
        print(f"\n{PROMPT!r}")
        print(f"  unpatched: {_top(tokenizer, unpatched)}")

        source_probe, probe = ProbePatch(), ProbePatch()
        with pg.patch({NODE: source_probe}):
            pg(source_ids, use_cache=False)
        with pg.patch({NODE: probe}):
            pg(ids, use_cache=False)
        delta = source_probe.activation[:, -1] - probe.activation[:, -1]  # (1, 576)
        with pg.patch({NODE: AddPatch(value=delta, slice=(slice(None), -1))}):
            patched = _logits(pg(ids, use_cache=False))
        print(f"  patched:   {_top(tokenizer, patched)}")
        print(
            f"  (AddPatch at {NODE}, last token: residual stream of {SOURCE_PROMPT!r} minus that of the prompt; "
            f"|delta| = {delta.norm().item():.1f})"
        )

    answer = tokenizer.decode(int(patched[0, -1].argmax()))
    print(f"\nprediction: {tokenizer.decode(int(unpatched[0, -1].argmax()))!r} -> {answer!r}")


if __name__ == "__main__":
    main()
