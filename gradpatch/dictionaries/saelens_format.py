"""SAELens's layout: a folder with ``cfg.json`` and ``sae_weights.safetensors`` (SAELens 6, ``SAE.save_model``).

Tensors (SAELens's names and orientations, the same as ours): ``W_enc`` ``[d_in, d_sae]``, ``b_enc`` ``[d_sae]``,
``W_dec`` ``[d_sae, d_out]``, ``b_dec`` ``[d_out]``, ``threshold`` ``[d_sae]`` (JumpReLU), ``W_skip``
``[d_out, d_in]`` (skip transcoders). ``cfg.json`` names the ``architecture``; the ones read and written here:

============================ ======================================================================
SAELens architecture         gradpatch dictionary
============================ ======================================================================
``standard``                 SAE, ReLU (``activation_fn`` ``relu``)
``topk``                     SAE, TopK (``k``); ``rescale_acts_by_decoder_norm`` folded into the weights
``jumprelu``                 SAE, JumpReLU (and a BatchTopK SAE on export, θ its evaluation threshold, as SAELens saves
                             BatchTopK SAEs for inference)
``transcoder``               Transcoder, ReLU
``skip_transcoder``          SkipTranscoder, ReLU
``jumprelu_transcoder``      Transcoder, JumpReLU
``jumprelu_skip_transcoder`` SkipTranscoder, JumpReLU
============================ ======================================================================

SAELens's JumpReLU is ReLU(h) · H(h − θ); ours is h · H(h − θ), the same function once θ < 0 is raised to 0, which
loading does. Configs from before SAELens 6 (``hook_point``, ``activation_fn_str``) are read as SAELens reads them.
Input normalisation (``normalize_activations`` other than ``"none"``) and ``hook_z`` reshaping are refused with a
:class:`~gradpatch.dictionaries.errors.DictionaryLoadError`: the dictionary would see other values than the node's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from safetensors.torch import save as save_safetensors

from ..files.atomic import atomic_write_bytes, atomic_write_text, read_json, read_tensors
from .errors import DictionaryConfigError, DictionaryLoadError
from .modules import DictionaryConfig, SparseDictionary
from .storage import dictionary_from_tensors

__all__ = ["SAELENS_CONFIG", "SAELENS_WEIGHTS", "export_saelens", "load_saelens"]

SAELENS_CONFIG = "cfg.json"
SAELENS_WEIGHTS = "sae_weights.safetensors"
#: architecture -> (kind, activation).
_ARCHITECTURES: dict[str, tuple[str, str]] = {
    "standard": ("sae", "relu"), "topk": ("sae", "topk"), "jumprelu": ("sae", "jumprelu"),
    "transcoder": ("transcoder", "relu"), "skip_transcoder": ("skip_transcoder", "relu"),
    "jumprelu_transcoder": ("transcoder", "jumprelu"), "jumprelu_skip_transcoder": ("skip_transcoder", "jumprelu")}
_FIX = "give the folder SAE.save_model wrote (cfg.json + sae_weights.safetensors)"


def _architecture(cfg: dict[str, Any], where: Path) -> str:
    """The SAELens 6 architecture of ``cfg``, pre-6 configs read as SAELens's ``handle_pre_6_0_config`` does."""
    architecture = cfg.get("architecture")
    if architecture is None:
        activation = cfg.get("activation_fn", cfg.get("activation_fn_str", "relu"))
        k = (cfg.get("activation_fn_kwargs") or {}).get("k")
        if activation == "topk" and k is not None:
            cfg["k"] = k
            return "topk"
        if activation != "relu":
            raise DictionaryLoadError(f"{where}: activation {activation!r} is not one gradpatch implements; {_FIX}")
        return "standard"
    if architecture not in _ARCHITECTURES:
        raise DictionaryLoadError(f"{where}: SAELens architecture {architecture!r} is not one gradpatch reads "
                                  f"({sorted(_ARCHITECTURES)}); gated, abstopk, matching_pursuit and temporal SAEs are "
                                  f"not implemented, and a BatchTopK or Matryoshka training checkpoint must first be "
                                  f"saved for inference by SAELens (it writes them as jumprelu)")
    return architecture


def load_saelens(directory: str | Path, node: str | None = None, output_node: str | None = None) -> SparseDictionary:
    """Read a dictionary SAELens saved (``cfg.json`` + ``sae_weights.safetensors``).

    Args:
        directory: the folder.
        node: the NodePath it reads (SAELens records TransformerLens hook names, which gradpatch cannot map).
        output_node: a transcoder's NodePath written.

    Returns:
        The dictionary, with the file's dtype.

    Raises:
        DictionaryLoadError: a missing or unreadable file (a gradpatch or sparsify folder is named as such), an
            architecture or option gradpatch does not implement, a missing or extra tensor, a width that does not
            fit ``cfg.json``, NaN or ±inf.
    """
    directory = Path(directory)
    cfg_path = directory / SAELENS_CONFIG
    if not (directory / SAELENS_WEIGHTS).is_file() and (directory / "sae.safetensors").is_file():
        raise DictionaryLoadError(f"{directory} holds sae.safetensors, sparsify's layout: use load_sparsify")
    cfg = read_json(cfg_path, DictionaryLoadError, _FIX)
    kind, activation = _ARCHITECTURES[_architecture(cfg, cfg_path)]
    for option, neutral in (("normalize_activations", "none"), ("reshape_activations", "none")):
        value = cfg.get(option) or neutral
        if value != neutral:
            raise DictionaryLoadError(f"{cfg_path}: {option}={value!r} is not supported (gradpatch splices the "
                                      f"node's raw values); fold it into the weights or use an SAE saved without it")
    tensors = dict(read_tensors(directory / SAELENS_WEIGHTS, DictionaryLoadError, _FIX))
    if cfg.get("finetuning_scaling_factor") or "scaling_factor" in tensors:
        raise DictionaryLoadError(f"{directory}: SAELens's finetuning scaling factor is not supported; fold it "
                                  f"into W_dec (W_dec · scaling_factor[:, None]) and save again")
    try:
        config = DictionaryConfig(
            kind, activation, cfg.get("d_in"), cfg.get("d_sae"), cfg.get("d_out") if kind != "sae" else None,
            k=cfg.get("k") if activation == "topk" else None,
            apply_b_dec_to_input=kind == "sae" and bool(cfg.get("apply_b_dec_to_input", True)),
            input_node=node, output_node=output_node if kind != "sae" else None)
    except DictionaryConfigError as error:
        raise DictionaryLoadError(f"{cfg_path}: {error}; {_FIX}") from error
    if "threshold" in tensors:
        tensors["threshold"] = tensors["threshold"].clamp_min(0)
    if cfg.get("rescale_acts_by_decoder_norm") and {"W_enc", "b_enc", "W_dec"} <= set(tensors):
        norm = tensors["W_dec"].norm(dim=-1)
        tensors.update(W_enc=tensors["W_enc"] * norm, b_enc=tensors["b_enc"] * norm,
                       W_dec=tensors["W_dec"] / norm[:, None])
    return dictionary_from_tensors(config, tensors, str(directory / SAELENS_WEIGHTS), _FIX)


def _export_architecture(config: DictionaryConfig) -> str:
    wanted = (config.kind, "jumprelu" if config.activation == "batchtopk" else config.activation)
    for architecture, pair in _ARCHITECTURES.items():
        if pair == wanted:
            return architecture
    raise DictionaryConfigError(f"SAELens has no architecture for a {config.kind} with activation "
                                f"{config.activation}; save it with save_dictionary instead")


def export_saelens(dictionary: SparseDictionary, directory: str | Path, hook_name: str | None = None,
                   model_name: str | None = None) -> Path:
    """Write ``dictionary`` in SAELens 6's layout (each file atomically, the weights first).

    Args:
        dictionary: the dictionary; a BatchTopK SAE is written as JumpReLU with θ its evaluation threshold.
        directory: the folder (created if missing).
        hook_name: the TransformerLens hook name recorded in the metadata (defaults to the input NodePath).
        model_name: the model name recorded in the metadata.

    Returns:
        ``directory``.

    Raises:
        DictionaryConfigError: a kind and activation SAELens has no architecture for (a TopK or BatchTopK
            transcoder).
    """
    directory = Path(directory)
    config = dictionary.config
    architecture = _export_architecture(config)
    state = {name: t.detach().contiguous().cpu().clone() for name, t in dictionary.state_dict().items()}
    if config.activation == "batchtopk":
        state["threshold"] = state.pop("batch_threshold").expand(config.d_sae).clone()
    cfg: dict[str, Any] = {
        "architecture": architecture, "d_in": config.d_in, "d_sae": config.d_sae,
        "dtype": str(state["W_enc"].dtype).removeprefix("torch."), "device": "cpu",
        "apply_b_dec_to_input": config.apply_b_dec_to_input, "normalize_activations": "none",
        "reshape_activations": "none",
        "metadata": {"hook_name": hook_name or config.input_node, "model_name": model_name,
                     "sae_lens_version": "6.0.0"}}
    if architecture == "topk":
        cfg.update(k=config.k, rescale_acts_by_decoder_norm=False)
    if config.kind != "sae":
        cfg["d_out"] = config.d_out
    atomic_write_bytes(directory / SAELENS_WEIGHTS, save_safetensors(state))
    atomic_write_text(directory / SAELENS_CONFIG, json.dumps(cfg, indent=2))
    return directory
