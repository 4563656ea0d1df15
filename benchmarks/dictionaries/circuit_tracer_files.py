"""Dictionaries against circuit-tracer: a transcoder set its loader reads gives the same latents and outputs in both
libraries, and so does the set gradpatch exports.

A two-layer set of ReLU skip transcoders (random, seeded; d_model 32, 96 latents) is written in circuit-tracer's local
layout (``config.yaml`` + ``layer_<i>.safetensors`` with ``W_enc`` ``[d_sae, d_model]``, ``W_dec`` ``[d_model, d_sae]``,
``b_enc``, ``b_dec``, ``W_skip``). circuit-tracer (benchmarks/peers/circuit_tracer/files_side.py, in its own
virtualenv) loads it with ``load_transcoder_set`` and gradpatch with
:func:`gradpatch.dictionaries.load_circuit_tracer`; their latents and outputs on the same inputs are compared. Then
gradpatch exports its transcoders (:func:`~gradpatch.dictionaries.export_circuit_tracer`), circuit-tracer loads the
export and the comparison is repeated. Prints JSON: per direction and layer, the largest absolute differences.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.dictionaries.circuit_tracer_files`` (circuit-tracer at
commit d797c82, which is not on PyPI: ``.peers/circuit_tracer_d797c82``, which ``make peers
PEERS=circuit_tracer_d797c82`` installs from its repository; ``--python`` names another virtualenv's Python and
``--source`` a source folder to put on its PYTHONPATH instead).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
import yaml
from safetensors.torch import load_file, save_file

from benchmarks.harness import emit, peer_python, run_module
from gradpatch.dictionaries import SparseDictionary, export_circuit_tracer, load_circuit_tracer

SIDE = "benchmarks.peers.circuit_tracer.files_side"
D_MODEL, D_SAE = 32, 96


def write_set(folder: Path) -> Path:
    """Two random ReLU skip transcoders in circuit-tracer's local layout; returns the ``config.yaml``."""
    generator = torch.Generator().manual_seed(1)
    entries = []
    folder.mkdir(parents=True)
    for layer in range(2):
        shapes = {"W_enc": (D_SAE, D_MODEL), "W_dec": (D_MODEL, D_SAE), "b_enc": (D_SAE,), "b_dec": (D_MODEL,),
                  "W_skip": (D_MODEL, D_MODEL)}
        save_file({name: torch.randn(shape, generator=generator) * 0.3 for name, shape in shapes.items()},
                  str(folder / f"layer_{layer}.safetensors"))
        entries.append({"id": f"layer-{layer}", "layer": layer, "filepath": str(folder / f"layer_{layer}.safetensors")})
    config = folder / "config.yaml"
    config.write_text(yaml.safe_dump({"model_name": "random", "feature_input_hook": "hook_resid_mid",
                                      "feature_output_hook": "mlp.hook_out", "transcoders": entries}))
    return config


def compare(transcoders: dict[int, SparseDictionary], folder: Path) -> dict[str, dict[str, float]]:
    report = {}
    for layer, transcoder in transcoders.items():
        reference = load_file(str(folder / f"circuit_tracer_outputs_{layer}.safetensors"))
        with torch.no_grad():
            ours = {"latents": transcoder.encode(reference["x"]), "forward": transcoder(reference["x"])}
        report[f"layer_{layer}"] = {name: float((ours[name] - reference[name]).abs().max()) for name in ours}
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", help="the Python of circuit-tracer d797c82's virtualenv (default: "
                                          ".peers/circuit_tracer_d797c82/bin/python)")
    parser.add_argument("--source", help="circuit-tracer's source folder (holding circuit_tracer/), put on the "
                                         "PYTHONPATH (default: none, circuit-tracer installed in that virtualenv)")
    args = parser.parse_args()
    python = peer_python("circuit_tracer_d797c82", args.python)
    path = [args.source] if args.source else []
    with tempfile.TemporaryDirectory() as scratch:
        config = write_set(Path(scratch) / "set")
        run_module(python, SIDE, ["outputs", str(config)], extra_path=path)
        transcoders = load_circuit_tracer(config, "in{layer}", "out{layer}")
        report = {"loaded": compare(transcoders, config.parent)}
        exported = export_circuit_tracer(transcoders, Path(scratch) / "exported", "random", "hook_resid_mid",
                                         "mlp.hook_out")
        run_module(python, SIDE, ["outputs", str(exported)], extra_path=path)
        report["exported"] = compare(transcoders, exported.parent)
    emit({"max_abs_difference": report})


if __name__ == "__main__":
    main()
