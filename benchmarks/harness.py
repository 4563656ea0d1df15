"""What every benchmark shares: timing, peak memory, the JSON header and report, and the peers' interpreters.

No gradpatch import and no top-level torch import, so that a side script running in a peer's virtualenv
(``benchmarks/peers/<peer>/``) measures and reports with this very code, and so that a script may set torch's
environment variables before torch loads.

- Memory (Linux): :func:`reset_peak` before a stretch, :func:`peak_mib` after it (the kernel's high-water mark
  ``VmHWM``; writing ``5`` to ``/proc/self/clear_refs`` resets it to the current resident size, Linux ≥ 4.0,
  proc(5)); :func:`resident_mib` is the resident size now (``VmRSS``), :func:`max_rss_mib` the process's peak since
  it started (``getrusage``), :func:`cuda_peak_mib` torch's peak of allocated CUDA memory.
- Time: :func:`median`, :func:`round_robin` (interleaved calls of several variants) and :func:`timed_steps`
  (optimizer steps with their memory, the same way on both sides of a peer comparison).
- Report: :func:`header` (git commit, versions of python / torch / transformers / gradpatch, device) and
  :func:`emit`, which prints a report as JSON under that header.
- Peers: :func:`peer_python` finds a peer's interpreter (an option, else ``GRADPATCH_PEER_<PEER>`` in the
  environment, else ``.peers/<peer>/bin/python`` that ``make peers`` builds); :func:`run_module` runs a module of
  this repository (a peer's side script or a script's own subprocess) with the repository importable.
"""

from __future__ import annotations

import gc
import importlib.metadata
import json
import os
import platform
import re
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    import torch

#: The repository's root folder (holding ``benchmarks/``).
ROOT = Path(__file__).resolve().parent.parent
#: Where ``make peers`` builds each peer's virtualenv (``.peers/<peer>/``; git ignores it).
PEERS_HOME = ROOT / ".peers"
#: The distributions whose versions :func:`header` reports.
VERSIONED = ("torch", "transformers", "gradpatch")

_STATUS = Path("/proc/self/status")
T = TypeVar("T")


# ------------------------------------------------------------------------------------------------------------ memory


def _status_kib(field: str) -> int:
    match = re.search(rf"^{field}:\s+(\d+) kB", _STATUS.read_text(), re.MULTILINE)
    if match is None:
        raise RuntimeError(f"{_STATUS} has no {field} line: peak memory needs Linux's procfs")
    return int(match.group(1))


def reset_peak() -> None:
    """Collect garbage, then reset the process's peak resident size (``VmHWM``) to its current resident size."""
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")


def peak_mib() -> float:
    """The peak resident size (MiB) since the last :func:`reset_peak` (or since the process started)."""
    return _status_kib("VmHWM") / 1024


def resident_mib() -> float:
    """The resident size now (MiB)."""
    return _status_kib("VmRSS") / 1024


def max_rss_mib() -> float:
    """The process's peak resident size since it started (MiB, ``getrusage``'s ``ru_maxrss``; never reset)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def cuda_peak_mib(device: str) -> float | None:
    """The peak of CUDA memory allocated by torch (MiB) on a CUDA ``device``, ``None`` for any other device."""
    if not device.startswith("cuda"):
        return None
    import torch

    return torch.cuda.max_memory_allocated(torch.device(device)) / 2**20


# -------------------------------------------------------------------------------------------------------------- time


def median(values: Sequence[float]) -> float:
    """The upper median (the middle element of the sorted values)."""
    return sorted(values)[len(values) // 2]


def seconds_of(fn: Callable[[], Any]) -> float:
    """Wall-clock seconds of one call of ``fn``."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def round_robin(variants: dict[str, Callable[[], Any]], runs: int, warmup: int) -> dict[str, float]:
    """Median seconds of each variant, one call of each per round (``warmup`` rounds first, not counted), so that
    the machine's drift reaches every variant alike."""
    times: dict[str, list[float]] = {name: [] for name in variants}
    for round_index in range(warmup + runs):
        for name, fn in variants.items():
            elapsed = seconds_of(fn)
            if round_index >= warmup:
                times[name].append(elapsed)
    return {name: statistics.median(values) for name, values in times.items()}


@dataclass
class TimedSteps:
    """Per step: ``losses`` (the loss's float), ``seconds`` and ``cpu_seconds`` (wall and process CPU time from the
    forward pass through ``optimizer.step()``); ``resident_mib_before`` the resident memory before the first step,
    ``peak_mib`` its peak during the steps (MiB)."""

    losses: list[float]
    seconds: list[float]
    cpu_seconds: list[float]
    resident_mib_before: float
    peak_mib: float


def timed_steps(optimizer: torch.optim.Optimizer, batches: Iterable[T],
                loss_of: Callable[[T], torch.Tensor]) -> TimedSteps:
    """One step per batch: ``loss_of(batch)`` (a scalar), backward, ``optimizer.step()``; garbage collected and the
    memory peak reset before the first."""
    gc.collect()
    before = resident_mib()
    reset_peak()
    losses, seconds, cpu_seconds = [], [], []
    for batch in batches:
        start, cpu = time.perf_counter(), time.process_time()
        loss = loss_of(batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        seconds.append(time.perf_counter() - start)
        cpu_seconds.append(time.process_time() - cpu)
        losses.append(float(loss.detach()))
    return TimedSteps(losses, seconds, cpu_seconds, before, peak_mib())


# ------------------------------------------------------------------------------------------------------------ report


def version_of(distribution: str) -> str | None:
    """The installed version of ``distribution`` in this interpreter, ``None`` when it is not installed."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def git_commit() -> str | None:
    """The repository's ``HEAD`` commit, with ``-dirty`` when tracked files differ from it; ``None`` outside git."""
    def git(*arguments: str) -> str:
        return subprocess.run(["git", "-C", str(ROOT), *arguments], capture_output=True, text=True,
                              check=True).stdout.strip()

    try:
        commit = git("rev-parse", "HEAD")
        return commit + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.CalledProcessError):
        return None


#: The commit this process started from (:func:`git_commit` when the harness was imported): what a report records,
#: so that a long run outliving a commit reports the code it imported, not the repository's state at its end.
STARTING_COMMIT = git_commit()


def device_name(device: str = "cpu") -> str:
    """What ``device`` is on this machine: the GPU's name for a CUDA device, else the processor's model name
    (``/proc/cpuinfo``), else its architecture."""
    if device.startswith("cuda"):
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name(torch.device(device))
    cpuinfo = Path("/proc/cpuinfo")
    match = re.search(r"^model name\s*:\s*(.+)$", cpuinfo.read_text(), re.MULTILINE) if cpuinfo.exists() else None
    return match.group(1).strip() if match else platform.processor() or platform.machine()


def header(device: str = "cpu") -> dict[str, Any]:
    """The JSON header of a report: the git commit the process started from (:data:`STARTING_COMMIT`), the versions
    of python and of :data:`VERSIONED` in this interpreter (each ``None`` where this process has not imported it: a
    peer's side reports no gradpatch), the device measured on and its name, torch's thread count and the
    interpreter's path."""
    threads = None
    if "torch" in sys.modules:
        threads = sys.modules["torch"].get_num_threads()
    return {"git_commit": STARTING_COMMIT, "python": platform.python_version(),
            **{name: version_of(name) if name in sys.modules else None for name in VERSIONED},
            "device": device, "device_name": device_name(device), "torch_threads": threads,
            "interpreter": sys.executable}


def emit(report: dict[str, Any], device: str = "cpu", indent: int | None = 2) -> None:
    """Print ``report`` as one JSON object on stdout, under the key ``header`` (:func:`header`)."""
    print(json.dumps({"header": header(device), **report}, indent=indent, ensure_ascii=False), flush=True)


# ------------------------------------------------------------------------------------------------------------- peers


def peer_python(peer: str, override: str | None = None) -> str:
    """The interpreter of ``peer``'s virtualenv: ``override`` (a script's option) when given, else the environment
    variable ``GRADPATCH_PEER_<PEER>`` (upper case, ``-`` as ``_``), else ``.peers/<peer>/bin/python``.

    Raises:
        FileNotFoundError: that interpreter does not exist; the message names the command that builds it.
    """
    variable = "GRADPATCH_PEER_" + re.sub(r"\W", "_", peer).upper()
    python = override or os.environ.get(variable) or str(PEERS_HOME / peer / "bin" / "python")
    if not Path(python).exists():
        raise FileNotFoundError(f"no Python for the peer {peer!r} at {python}: build it with `make peers "
                                f"PEERS={peer}` (benchmarks/peers/build.sh), or name one with {variable} or the "
                                f"script's option")
    return python


def save_for_peers(model: Any, tokenizer: Any | None, directory: Path) -> None:
    """Write the model as a plain ``from_pretrained`` folder (config without the GGUF quantization record,
    ``model.safetensors`` without the tied ``lm_head.weight``, the tokenizer when one is given): transformers refuses
    ``save_pretrained`` on a model loaded from GGUF."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    type(model.config).from_dict(config).save_pretrained(directory)
    state = {name: tensor.detach().contiguous() for name, tensor in model.state_dict().items()}
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)


def offline_environment(threads: int | None = None) -> dict[str, str]:
    """This process's environment for a side process: Hugging Face offline, no tokenizer threads and, with
    ``threads``, ``OMP_NUM_THREADS`` / ``MKL_NUM_THREADS`` set to it (else inherited)."""
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    if threads is not None:
        environment.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    return environment


def run_module(python: str, module: str, arguments: Sequence[str] = (), *, env: dict[str, str] | None = None,
               extra_path: Sequence[str] = (), check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run ``python -m module arguments`` from the repository's root with the repository (then ``extra_path``) on
    ``PYTHONPATH``, output captured as text.

    Raises:
        SystemExit: ``check`` and the process failed; its output's tail is written to stderr first.
    """
    environment = dict(os.environ if env is None else env)
    environment["PYTHONPATH"] = os.pathsep.join([str(ROOT), *extra_path])
    command = [python, "-m", module, *arguments]
    result = subprocess.run(command, cwd=ROOT, env=environment, capture_output=True, text=True)
    if check and result.returncode:
        sys.stderr.write(result.stdout[-4000:] + result.stderr[-8000:])
        raise SystemExit(f"{' '.join(command[:3])} failed with exit status {result.returncode}")
    return result


def peer_version(python: str, distribution: str) -> str:
    """The version of ``distribution`` installed for the interpreter ``python`` (a peer's)."""
    code = "import importlib.metadata, sys; print(importlib.metadata.version(sys.argv[1]))"
    return subprocess.run([python, "-c", code, distribution], capture_output=True, text=True,
                          check=True).stdout.strip()


def run_module_json(python: str, module: str, arguments: Sequence[str] = (), **options: Any) -> dict[str, Any]:
    """:func:`run_module`, then the JSON object its stdout ends with (a report that :func:`emit` printed)."""
    stdout = run_module(python, module, arguments, **options).stdout
    return json.loads(stdout[stdout.rindex("\n{") + 1:] if "\n{" in stdout else stdout)
