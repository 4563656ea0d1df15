"""Dictionaries against EleutherAI's sparsify: a sparse coder sparsify saved gives the same latents and outputs when
gradpatch loads it.

sparsify (in its own virtualenv: benchmarks/peers/sparsify/files_side.py) builds a randomly initialised TopK sparse
autoencoder, transcoder and skip transcoder and saves them in its layout; gradpatch loads each with
:func:`gradpatch.dictionaries.load_sparsify` and compares the latents and the forward output on the same inputs with
sparsify's own. Prints JSON: per kind, the largest absolute differences (float32).

Run: ``OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.dictionaries.sparsify_files`` (eai-sparsify from
``.peers/sparsify``, ``make peers PEERS=sparsify``; ``--python`` names another).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file

from benchmarks.harness import emit, peer_python, peer_version, run_module
from gradpatch.dictionaries import load_sparsify


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", help="the Python of sparsify's virtualenv (default: .peers/sparsify/bin/python)")
    args = parser.parse_args()
    python = peer_python("sparsify", args.python)
    report: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as scratch:
        run_module(python, "benchmarks.peers.sparsify.files_side", ["make", scratch])
        for folder in sorted(path for path in Path(scratch).iterdir() if path.is_dir()):
            dictionary = load_sparsify(folder)
            reference = load_file(str(folder / "sparsify_outputs.safetensors"))
            with torch.no_grad():
                ours = {"latents": dictionary.encode(reference["x"]), "forward": dictionary(reference["x"])}
            report[folder.name] = {name: float((ours[name] - reference[name]).abs().max()) for name in ours}
    emit({"eai_sparsify": peer_version(python, "eai-sparsify"), "max_abs_difference": report})


if __name__ == "__main__":
    main()
