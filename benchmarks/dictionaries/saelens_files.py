"""Dictionaries against SAELens: the same SAE file gives the same latents and outputs in both libraries, both ways.

SAELens (in its own virtualenv: benchmarks/peers/saelens/saelens_side.py) builds one randomly initialised SAE per
architecture that gradpatch reads and saves it in its layout; gradpatch loads each with
:func:`gradpatch.dictionaries.load_saelens` and compares ``encode``, ``decode(encode(x))`` and ``forward`` on the
same inputs with SAELens's own outputs. Then gradpatch exports each with :func:`~gradpatch.dictionaries.export_saelens`,
SAELens loads the exports with ``SAE.load_from_disk`` and the same three are compared again. Prints JSON: per
architecture, the largest absolute differences (float32).

Run: ``OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.dictionaries.saelens_files`` (SAELens from
``.peers/saelens``, ``make peers PEERS=saelens``; ``--python`` names another).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file

from benchmarks.harness import emit, peer_python, peer_version, run_module
from gradpatch.dictionaries import SparseDictionary, export_saelens, load_saelens

SIDE = "benchmarks.peers.saelens.saelens_side"


def differences(dictionary: SparseDictionary, folder: Path) -> dict[str, float]:
    """Largest |gradpatch − SAELens| of the latents, decoded latents and forward on SAELens's inputs."""
    reference = load_file(str(folder / "saelens_outputs.safetensors"))
    with torch.no_grad():
        latents = dictionary.encode(reference["x"])
        ours = {"latents": latents, "decoded": dictionary.decode(latents), "forward": dictionary(reference["x"])}
    return {name: float((ours[name] - reference[name]).abs().max()) for name in ours}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", help="the Python of SAELens's virtualenv (default: .peers/saelens/bin/python)")
    args = parser.parse_args()
    python = peer_python("saelens", args.python)
    with tempfile.TemporaryDirectory() as scratch:
        made, exported = Path(scratch) / "saelens", Path(scratch) / "exported"
        run_module(python, SIDE, ["make", str(made)])
        report: dict[str, dict] = {}
        for folder in sorted(path for path in made.iterdir() if path.is_dir()):
            dictionary = load_saelens(folder)
            report[folder.name] = {"loaded": differences(dictionary, folder)}
            export_saelens(dictionary, exported / folder.name)
        run_module(python, SIDE, ["check", str(exported)])
        for folder in sorted(path for path in exported.iterdir() if path.is_dir()):
            report[folder.name]["exported"] = differences(load_saelens(folder), folder)
    emit({"sae_lens": peer_version(python, "sae-lens"), "max_abs_difference": report})


if __name__ == "__main__":
    main()
