"""Cross-layer transcoders against circuit-tracer 0.5.0: a CLT its own code writes reads into gradpatch with the same
latents and outputs, and the CLT gradpatch exports reads back into circuit-tracer with the same again.

For each activation (ReLU, JumpReLU), circuit-tracer's side (this module run with ``--side`` in its virtualenv; it
imports no gradpatch) builds a random ``CrossLayerTranscoder`` (seeded; 4 layers, d_model 32, 48 latents per layer,
float32), writes it with its ``to_safetensors`` and saves its ``encode(x)`` and ``forward(x)`` on inputs ``x``
``[L, 64, d_model]`` (seed 0). gradpatch reads the folder with :func:`~gradpatch.dictionaries.load_circuit_tracer_clt`
and computes the same; then exports it with :func:`~gradpatch.dictionaries.export_circuit_tracer_clt`, checks that
the exported files hold the very tensors circuit-tracer wrote (names, dtypes, shapes and bytes; and whether the files
are byte-identical), and circuit-tracer's ``load_clt`` (lazy decoder, its default) reads the export and computes the
outputs again. Prints JSON: per activation and direction, the largest absolute differences of latents and outputs.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.dictionaries.circuit_tracer_clt`` (peer ``circuit_tracer``:
``.peers/circuit_tracer/bin/python``, ``--python`` names another).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from benchmarks.harness import emit, peer_python, run_module

if TYPE_CHECKING:
    import torch

N_LAYERS, D_MODEL, D_SAE, ROWS = 4, 32, 48, 64
OUTPUTS = "circuit_tracer_outputs.safetensors"


# ---------------------------------------------------------------------------------- circuit-tracer's side (its venv)


def _inputs() -> torch.Tensor:
    import torch

    return torch.randn(N_LAYERS, ROWS, D_MODEL, generator=torch.Generator().manual_seed(0))


def _save_outputs(clt: object, folder: Path) -> None:
    import torch
    from safetensors.torch import save_file

    x = _inputs()
    with torch.no_grad():
        tensors = {"x": x, "latents": clt.encode(x), "forward": clt(x)}  # type: ignore[attr-defined,operator]
    save_file({name: t.contiguous() for name, t in tensors.items()}, str(folder / OUTPUTS))


def side_write(folder: Path, activation: str) -> None:
    """circuit-tracer builds a random CLT, writes it with ``to_safetensors`` into ``folder / "clt"`` and its outputs
    into ``folder``."""
    import torch
    from circuit_tracer.transcoder.cross_layer_transcoder import CrossLayerTranscoder

    clt = CrossLayerTranscoder(N_LAYERS, D_SAE, D_MODEL, activation_function=activation, lazy_decoder=False,
                               device=torch.device("cpu"), dtype=torch.float32)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, parameter in clt.named_parameters():
            scale = 0.2 if "W_" in name else 0.05
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * scale)
            if name.endswith("threshold"):
                parameter.abs_()
    clt.to_safetensors(str(folder / "clt"))
    _save_outputs(clt, folder)


def side_outputs(folder: Path) -> None:
    """circuit-tracer reads the CLT in ``folder / "clt"`` with ``load_clt`` and writes its outputs into ``folder``."""
    import torch
    from circuit_tracer.transcoder.cross_layer_transcoder import load_clt

    clt = load_clt(str(folder / "clt"), device=torch.device("cpu"), dtype=torch.float32)
    _save_outputs(clt, folder)


# ------------------------------------------------------------------------------------------------------ gradpatch's


def compare(clt: object, folder: Path) -> dict[str, float]:
    """Largest absolute differences between gradpatch's latents and outputs and circuit-tracer's in ``folder`` (and,
    for scale, the largest output and the mean number of active latents per row and layer)."""
    import torch
    from safetensors.torch import load_file

    reference = load_file(str(folder / OUTPUTS))
    xs = list(reference["x"])
    with torch.no_grad():
        latents = torch.stack([clt.encode(layer, x) for layer, x in enumerate(xs)])  # type: ignore[attr-defined]
        outputs = torch.stack(clt(xs))  # type: ignore[operator]
    return {"latents": float((latents - reference["latents"]).abs().max()),
            "forward": float((outputs - reference["forward"]).abs().max()),
            "forward_largest_value": float(reference["forward"].abs().max()),
            "active_latents_per_row": float((latents != 0).sum(-1).float().mean())}


def same_files(theirs: Path, ours: Path) -> dict[str, bool]:
    """Whether the two folders hold the same file names, the same tensors (names, dtypes, shapes, bytes), and
    byte-identical files."""
    import torch
    from safetensors.torch import load_file

    names = sorted(p.name for p in theirs.iterdir())
    tensors = names == sorted(p.name for p in ours.iterdir())
    files = tensors
    for name in names if tensors else []:
        a, b = load_file(str(theirs / name)), load_file(str(ours / name))
        tensors = tensors and sorted(a) == sorted(b) and all(
            a[k].dtype == b[k].dtype and a[k].shape == b[k].shape
            and torch.equal(a[k].contiguous().view(torch.uint8), b[k].contiguous().view(torch.uint8)) for k in a)
        files = files and (theirs / name).read_bytes() == (ours / name).read_bytes()
    return {"same_tensors": tensors, "same_file_bytes": files}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", help="the Python of circuit-tracer 0.5.0's virtualenv (default: "
                                          ".peers/circuit_tracer/bin/python)")
    args = parser.parse_args()
    from gradpatch.dictionaries import export_circuit_tracer_clt, load_circuit_tracer_clt

    python = peer_python("circuit_tracer", args.python)
    module = "benchmarks.dictionaries.circuit_tracer_clt"
    report: dict[str, dict[str, object]] = {}
    with tempfile.TemporaryDirectory() as scratch:
        for activation in ("relu", "jump_relu"):
            written, exported = Path(scratch) / activation / "written", Path(scratch) / activation / "exported"
            written.mkdir(parents=True)
            run_module(python, module, ["--side", "write", str(written), activation])
            clt = load_circuit_tracer_clt(written / "clt", "in{layer}", "out{layer}")
            entry: dict[str, object] = {"gradpatch_activation": clt.config.activation,
                                        "loaded_vs_circuit_tracer": compare(clt, written)}
            export_circuit_tracer_clt(clt, exported / "clt")
            entry["export_vs_circuit_tracer_files"] = same_files(written / "clt", exported / "clt")
            run_module(python, module, ["--side", "outputs", str(exported)])
            entry["circuit_tracer_reading_export_vs_gradpatch"] = compare(clt, exported)
            report[activation] = entry
    emit({"n_layers": N_LAYERS, "d_model": D_MODEL, "d_sae": D_SAE, "rows": ROWS, "circuit_tracer": "0.5.0",
          "max_abs_difference": report})


if __name__ == "__main__":
    if sys.argv[1:2] == ["--side"]:
        command, folder = sys.argv[2], Path(sys.argv[3])
        side_write(folder, sys.argv[4]) if command == "write" else side_outputs(folder)
    else:
        main()
