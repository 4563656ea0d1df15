"""How exact a spliced dictionary is: the largest |logit difference| between the model and the model with a dictionary
spliced, with and without the error term; prints JSON.

For the tiny random Llama and GPT-2 of the test suite (``tests/conftest.py``'s ``llama_graph`` / ``gpt2_graph``:
d_model 64, prompts ``[3, 6]``) and, with ``--real``, the embedded SmolLM2-135M-Instruct (float32, CPU, one prompt),
it splices a randomly initialised TopK SAE (4× width) at a residual node and a TopK skip transcoder from an MLP's
input to its output. Untrained dictionaries reconstruct badly, so ``dropped`` is large; ``kept`` is float rounding.

Run: ``.venv/bin/python -m benchmarks.dictionaries.exactness [--real]``.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from benchmarks.harness import emit
from gradpatch import PatchableGraph, testing
from gradpatch.dictionaries import SkipTranscoder, SparseAutoencoder, splice


def _differences(pg: PatchableGraph, ids: torch.Tensor, width: int, residual: str, mlp: tuple[str, str]) -> dict:
    """{"sae" | "skip_transcoder": {"kept": float, "dropped": float}}: max |Δ logits| with / without the error term."""
    generator = torch.Generator().manual_seed(0)
    dictionaries: dict[str, tuple[Any, str, str]] = {
        "sae": (SparseAutoencoder(width, 4 * width, "topk", 32, generator=generator), residual, residual),
        "skip_transcoder": (SkipTranscoder(width, 4 * width, activation="topk", k=32, generator=generator), *mlp)}
    with torch.no_grad():
        reference = pg(ids, use_cache=False).logits
        report = {}
        for name, (dictionary, read, write) in dictionaries.items():
            row = {}
            for label, error_term in (("kept", True), ("dropped", False)):
                with pg.patch(splice(pg, dictionary, read, output_node=write, error_term=error_term)):
                    row[label] = float((pg(ids, use_cache=False).logits - reference).abs().max())
            report[name] = row
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--real", action="store_true", help="also the embedded SmolLM2-135M-Instruct (about 30 s)")
    args = parser.parse_args()
    ids = testing.random_prompt_batch().clean
    llama = testing.tiny_llama(100, hidden=64, intermediate=128, init_std=0.02, max_position_embeddings=128,
                               pad_token_id=None, bos_token_id=1, eos_token_id=2)
    gpt2 = testing.tiny_gpt2(100, hidden=64, init_std=0.02, n_positions=128)
    report: dict[str, Any] = {
        "tiny_llama": _differences(PatchableGraph(llama, ids, use_cache=False), ids, 64, "model.layers_0.output",
                                   ("model.layers_0.mlp.x", "model.layers_0.mlp.output")),
        "tiny_gpt2": _differences(PatchableGraph(gpt2, ids, use_cache=False), ids, 64, "transformer.h_1.output",
                                  ("transformer.h_0.mlp.hidden_states", "transformer.h_0.mlp.output"))}
    if args.real:
        from gradpatch.files.loaders import load_embedded_model

        model, tokenizer = load_embedded_model()
        text = tokenizer("The Eiffel Tower is located in the city of", return_tensors="pt").input_ids
        pg = PatchableGraph(model, text, use_cache=False)
        report["smollm2_135m"] = _differences(pg, text, 576, "model.layers_12.output",
                                              ("model.layers_12.mlp.x", "model.layers_12.mlp.output"))
    emit(report)


if __name__ == "__main__":
    main()
