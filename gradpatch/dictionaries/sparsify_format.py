"""EleutherAI sparsify's layout: a folder with ``cfg.json`` and ``sae.safetensors`` (``SparseCoder.save_to_disk``).

sparsify's tensors are ``encoder.weight`` ``[d_sae, d_in]`` (an ``nn.Linear``), ``encoder.bias`` ``[d_sae]``,
``W_dec`` ``[d_sae, d_in]``, ``b_dec`` ``[d_in]`` and, with ``skip_connection``, ``W_skip`` ``[d_in, d_in]``
(applied as x W_skipᵀ). Its encoder is TopK on ReLU(x W_encᵀ + b_enc) with ``x − b_dec`` as input for autoencoders
and ``x`` for transcoders (``transcode``), so it loads as our TopK :class:`~gradpatch.dictionaries.SparseAutoencoder`
(``apply_b_dec_to_input``), :class:`~gradpatch.dictionaries.Transcoder` or
:class:`~gradpatch.dictionaries.SkipTranscoder` with ``W_enc = encoder.weightᵀ``. sparsify's ``groupmax`` activation
is not implemented here.
"""

from __future__ import annotations

from pathlib import Path

from ..files.atomic import read_json, read_tensors
from .errors import DictionaryConfigError, DictionaryLoadError
from .modules import DictionaryConfig, SparseDictionary
from .storage import dictionary_from_tensors

__all__ = ["SPARSIFY_WEIGHTS", "load_sparsify"]

SPARSIFY_WEIGHTS = "sae.safetensors"
_FIX = "give the folder sparsify's SparseCoder.save_to_disk wrote (cfg.json + sae.safetensors)"


def load_sparsify(directory: str | Path, node: str | None = None, output_node: str | None = None) -> SparseDictionary:
    """Read a sparse coder sparsify saved.

    Args:
        directory: the folder (one hookpoint's, e.g. ``.../layers.12``).
        node: the NodePath it reads.
        output_node: a transcoder's NodePath written.

    Returns:
        A TopK dictionary with the file's dtype.

    Raises:
        DictionaryLoadError: a missing or unreadable file (an SAELens folder is named as such), the ``groupmax``
            activation, a skip connection on an autoencoder, a missing or extra tensor, a width that does not fit
            ``cfg.json``, NaN or ±inf.
    """
    directory = Path(directory)
    if not (directory / SPARSIFY_WEIGHTS).is_file() and (directory / "sae_weights.safetensors").is_file():
        raise DictionaryLoadError(f"{directory} holds sae_weights.safetensors, SAELens's layout: use load_saelens")
    cfg_path = directory / "cfg.json"
    cfg = read_json(cfg_path, DictionaryLoadError, _FIX)
    activation = cfg.get("activation", "topk")
    if activation != "topk":
        raise DictionaryLoadError(f"{cfg_path}: sparsify activation {activation!r} is not implemented in gradpatch "
                                  f"(only topk)")
    transcode, skip = bool(cfg.get("transcode", False)), bool(cfg.get("skip_connection", False))
    if skip and not transcode:
        raise DictionaryLoadError(f"{cfg_path}: a sparse autoencoder with a skip connection is not implemented in "
                                  f"gradpatch; only transcoders take a skip term")
    d_in = cfg.get("d_in")
    d_sae = cfg.get("num_latents") or (d_in * cfg.get("expansion_factor", 32) if isinstance(d_in, int) else None)
    kind = "skip_transcoder" if skip else "transcoder" if transcode else "sae"
    try:
        config = DictionaryConfig(kind, "topk", d_in, d_sae, k=cfg.get("k", 32), apply_b_dec_to_input=not transcode,
                                  input_node=node, output_node=output_node if transcode else None)
    except DictionaryConfigError as error:
        raise DictionaryLoadError(f"{cfg_path}: {error}; {_FIX}") from error
    raw = read_tensors(directory / SPARSIFY_WEIGHTS, DictionaryLoadError, _FIX)
    renamed = {"encoder.weight": "W_enc", "encoder.bias": "b_enc"}
    tensors = {renamed.get(name, name): tensor for name, tensor in raw.items()}
    if "W_enc" in tensors:
        tensors["W_enc"] = tensors["W_enc"].T.contiguous()
    return dictionary_from_tensors(config, tensors, str(directory / SPARSIFY_WEIGHTS), _FIX)
