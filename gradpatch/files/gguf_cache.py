"""A converted copy of a GGUF model on disk, so that it is read from the GGUF file once.

transformers reads a GGUF file by parsing its metadata and dequantising its weights on every load, and the tokenizer
parses the file again: ~35 s for SmolLM2-135M-Instruct on 2 CPU cores, most of it spent outside the dequantisation.
:func:`converted_gguf_folder` does that once and keeps the result as a transformers folder (``config.json`` without the
GGUF quantisation record, ``model.safetensors`` with the dequantised float32 weights, the tokenizer's files), from which
``from_pretrained`` loads the same model in ~2 s. The folder's name records the GGUF file's size and modification time
and the transformers version that converted it, so a changed file or another converter gets a folder of its own.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .cache import cache_folder

__all__ = ["COMPLETE_RECORD", "converted_gguf_folder", "default_model_cache_dir", "write_converted_gguf"]

COMPLETE_RECORD = "gradpatch_conversion.json"  # written last: a folder without it is not used


def default_model_cache_dir() -> Path:
    """``$GRADPATCH_MODEL_CACHE`` if set, else ``~/.cache/gradpatch/models``."""
    return cache_folder("GRADPATCH_MODEL_CACHE", "models")


def converted_gguf_folder(gguf_path: Path, transformers: Any, cache_dir: Path | None = None,
                          convert: Callable[[Path, Any, Path], None] | None = None) -> Path:
    """The transformers folder holding ``gguf_path``'s model and tokenizer, converted now if it is not there yet.

    Args:
        gguf_path: the ``.gguf`` file.
        transformers: the imported transformers module (imported lazily by the caller).
        cache_dir: where converted folders live (``None``: :func:`default_model_cache_dir`).
        convert: writes the converted folder (``None``: :func:`write_converted_gguf`).

    Returns:
        The folder: ``AutoModelForCausalLM.from_pretrained(folder, dtype=...)`` gives the GGUF load's weights (the
        float32 dequantisation, cast to ``dtype`` as the GGUF load casts it) and ``AutoTokenizer`` its tokenizer.

    Raises:
        OSError: the cache folder cannot be written (the message names it and ``GRADPATCH_MODEL_CACHE``).

    The folder is written under a temporary name and renamed when complete, so a reader never sees half of it; of two
    processes converting at once, the first rename wins and the other's copy is removed.
    """
    stat = gguf_path.stat()
    root = (cache_dir or default_model_cache_dir()).expanduser()
    folder = root / f"{gguf_path.stem}-{stat.st_size}-{stat.st_mtime_ns}-transformers{transformers.__version__}"
    if (folder / COMPLETE_RECORD).is_file():
        return folder
    try:
        root.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=root))
    except OSError as error:
        raise OSError(f"Cannot write the converted model under {root} ({error}); set GRADPATCH_MODEL_CACHE to a "
                      f"writable folder") from None
    try:
        (convert or write_converted_gguf)(gguf_path, transformers, staging)
        try:
            os.replace(staging, folder)
        except OSError:
            if not (folder / COMPLETE_RECORD).is_file():  # not another process's complete copy: a real failure
                raise
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return folder


def write_converted_gguf(gguf_path: Path, transformers: Any, staging: Path) -> None:
    """Load ``gguf_path`` through transformers (float32) and write it to the empty folder ``staging`` as a plain
    transformers folder, the completion record last."""
    from safetensors.torch import save_model

    model = transformers.AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                              dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    record = model.config.to_dict()
    record.pop("quantization_config", None)  # the weights are dequantised: a plain float32 model from here on
    type(model.config).from_dict(record).save_pretrained(staging)
    model.generation_config.save_pretrained(staging)
    save_model(model, str(staging / "model.safetensors"), metadata={"format": "pt"})  # tied weights stored once
    tokenizer.save_pretrained(staging)
    (staging / COMPLETE_RECORD).write_text(json.dumps({"gguf_file": gguf_path.name}) + "\n", encoding="utf-8")
