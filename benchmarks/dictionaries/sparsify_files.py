"""Dictionaries against EleutherAI's sparsify: a sparse coder sparsify saved gives the same latents and outputs when
gradpatch loads it.

sparsify (in its own virtualenv: benchmarks/dictionaries_sparsify_side.py) builds a randomly initialised TopK sparse
autoencoder, transcoder and skip transcoder and saves them in its layout; gradpatch loads each with
:func:`gradpatch.dictionaries.load_sparsify` and compares the latents and the forward output on the same inputs with
sparsify's own. Prints JSON: per kind, the largest absolute differences (float32).

Run: ``PYTHONPATH=$PWD OMP_NUM_THREADS=1 .venv/bin/python benchmarks/dictionaries_sparsify.py
--python /work/peers/sparsify/bin/python`` (eai-sparsify 1.3.3 installed there).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file

from gradpatch.dictionaries import load_sparsify

SIDE = Path(__file__).with_name("dictionaries_sparsify_side.py")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", required=True, help="the Python of sparsify's virtualenv")
    args = parser.parse_args()
    report: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as scratch:
        subprocess.run([args.python, str(SIDE), "make", scratch], check=True, capture_output=True)
        for folder in sorted(path for path in Path(scratch).iterdir() if path.is_dir()):
            dictionary = load_sparsify(folder)
            reference = load_file(str(folder / "sparsify_outputs.safetensors"))
            with torch.no_grad():
                ours = {"latents": dictionary.encode(reference["x"]), "forward": dictionary(reference["x"])}
            report[folder.name] = {name: float((ours[name] - reference[name]).abs().max()) for name in ours}
    version = subprocess.run([args.python, "-m", "pip", "show", "eai-sparsify"], check=True, capture_output=True,
                             text=True).stdout.split("Version:")[1].split()[0]
    print(json.dumps({"eai_sparsify": version, "max_abs_difference": report}, indent=2))


if __name__ == "__main__":
    main()
