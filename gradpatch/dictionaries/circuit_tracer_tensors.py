"""One circuit-tracer per-layer transcoder file (safetensors) to and from gradpatch's tensors.

The layouts a file may have (all hold ``W_skip`` ``[d_model, d_model]``, applied as ``x W_skipᵀ``, when present):

- circuit-tracer 0.5.0 (``SingleLayerTranscoder.to_safetensors``, read by ``load_relu_transcoder``): ``W_enc``
  ``[d_sae, d_model]``, ``W_dec`` ``[d_sae, d_model]`` (latent ``i``'s decoder vector is row ``i``: layout
  ``"latent_rows"``), ``b_enc`` ``[d_sae]``, ``b_dec`` ``[d_model]``, JumpReLU's ``activation_function.threshold``
  ``[d_sae]`` (ReLU without it);
- circuit-tracer at commit d797c82 (and gradpatch's exports before 0.5.0's layout): the same but ``W_dec``
  ``[d_model, d_sae]`` (latent ``i`` is column ``i``: layout ``"latent_columns"``);
- Gemma Scope 2 (``load_gemma_scope_2_transcoder``): ``w_enc`` ``[d_model, d_sae]``, ``w_dec`` ``[d_sae, d_model]``,
  ``b_enc``, ``b_dec``, ``threshold`` ``[d_sae]``, optional ``affine_skip_connection`` (``W_skip``ᵀ); its lower-case
  names decide it.

``d_sae`` and ``d_model`` are read from ``b_enc`` and ``b_dec`` (as circuit-tracer does). ``W_dec``'s orientation is
decided by the file's own safetensors metadata (``decoder_layout``, which :func:`circuit_tracer_tensors` writes), else
by its shape; where ``d_sae == d_model`` and no metadata says, only the caller can decide (``layout=``), never a guess.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import torch
from safetensors import SafetensorError, safe_open

from ..files.atomic import read_tensors
from .errors import DictionaryConfigError, DictionaryLoadError
from .modules import DictionaryConfig, SparseDictionary
from .storage import dictionary_from_tensors

__all__ = ["DECODER_LAYOUTS", "LAYOUT_METADATA_KEY", "DecoderLayout", "circuit_tracer_tensors",
           "read_circuit_tracer_file"]

DecoderLayout = Literal["latent_rows", "latent_columns"]
#: ``W_dec`` ``[d_sae, d_model]`` (circuit-tracer 0.5.0) and ``[d_model, d_sae]`` (circuit-tracer d797c82).
DECODER_LAYOUTS: tuple[str, ...] = ("latent_rows", "latent_columns")
#: The safetensors metadata key that records a file's decoder layout (circuit-tracer ignores metadata).
LAYOUT_METADATA_KEY = "decoder_layout"
_THRESHOLD = "activation_function.threshold"
_GEMMA_SCOPE_2 = {"w_enc", "w_dec", "b_enc", "b_dec", "threshold"}
_FIX = "give a transcoder file as circuit-tracer 0.5.0's SingleLayerTranscoder.to_safetensors writes it"


def _ambiguous(file: Path, width: int) -> str:
    return (f"{file}: d_sae == d_model == {width}, so W_dec's orientation cannot be read from its shape and the file's "
            f"safetensors metadata has no {LAYOUT_METADATA_KEY!r}: pass layout='latent_rows' if W_dec[i] is latent "
            f"i's decoder vector (circuit-tracer 0.5.0's to_safetensors, and gradpatch's export) or "
            f"layout='latent_columns' if W_dec[:, i] is (circuit-tracer d797c82's layout), or write 'layout: ...' in "
            f"config.yaml; check by comparing the set's outputs with circuit-tracer's own loader")


def _decoder_layout(file: Path, w_dec: torch.Tensor, d_sae: int, d_model: int, recorded: str | None,
                    layout: str | None) -> str:
    """``"latent_rows"`` or ``"latent_columns"`` of ``w_dec`` (module docstring).

    Raises:
        DictionaryLoadError: a 2-d ``W_dec`` of neither shape, metadata or ``layout`` that contradict each other or
            the shape, an unknown layout name, or a square set that nothing decides.
    """
    for name, value in (("metadata", recorded), ("layout", layout)):
        if value is not None and value not in DECODER_LAYOUTS:
            raise DictionaryLoadError(f"{file}: {name} names decoder layout {value!r}, not one of {DECODER_LAYOUTS}")
    if recorded is not None and layout is not None and recorded != layout:
        raise DictionaryLoadError(f"{file}: the file records {LAYOUT_METADATA_KEY}={recorded!r} (its metadata, or "
                                  f"Gemma Scope 2's tensor names) but layout={layout!r} was given; drop the layout "
                                  f"(the file's own record decides)")
    shapes = {"latent_rows": (d_sae, d_model), "latent_columns": (d_model, d_sae)}
    if tuple(w_dec.shape) not in shapes.values():
        raise DictionaryLoadError(f"{file}: 'W_dec' has shape {tuple(w_dec.shape)}, but b_enc [{d_sae}] and b_dec "
                                  f"[{d_model}] need ({d_sae}, {d_model}) (or ({d_model}, {d_sae}), circuit-tracer "
                                  f"d797c82's layout): the widths do not fit; {_FIX}")
    by_shape = [name for name, shape in shapes.items() if tuple(w_dec.shape) == shape]
    decided = recorded or layout
    if decided is None:
        if len(by_shape) > 1:
            raise DictionaryLoadError(_ambiguous(file, d_sae))
        return by_shape[0]
    if decided not in by_shape:
        raise DictionaryLoadError(f"{file}: decoder layout {decided!r} needs W_dec {shapes[decided]}, but it is "
                                  f"{tuple(w_dec.shape)}; {_FIX}")
    return decided


def _metadata(file: Path) -> dict[str, str]:
    try:
        with safe_open(str(file), framework="pt") as handle:
            return dict(handle.metadata() or {})
    except (OSError, SafetensorError) as error:
        raise DictionaryLoadError(f"{file} is not a readable safetensors file ({error}); {_FIX}") from error


def read_circuit_tracer_file(file: Path, input_node: str, output_node: str,
                             layout: str | None = None) -> SparseDictionary:
    """Read one per-layer transcoder file in any of the layouts of the module docstring.

    Args:
        file: the ``.safetensors`` file.
        input_node, output_node: the NodePaths the transcoder reads and writes.
        layout: ``"latent_rows"`` or ``"latent_columns"``: ``W_dec``'s orientation where its shape and the file's
            metadata leave it open (``d_sae == d_model``); ``None``: decided by the file.

    Returns:
        a ReLU or JumpReLU :class:`~gradpatch.dictionaries.Transcoder` (a
        :class:`~gradpatch.dictionaries.SkipTranscoder` when the file holds ``W_skip``), in the file's dtype.

    Raises:
        DictionaryLoadError: the file missing or unreadable, a tensor missing, extra or of a wrong width, NaN or ±inf,
            ``log_thresholds`` (which circuit-tracer refuses too), or an orientation nothing decides.
    """
    tensors = dict(read_tensors(file, DictionaryLoadError, _FIX))
    if _GEMMA_SCOPE_2 <= set(tensors):  # its names decide: w_enc [d_model, d_sae], w_dec [d_sae, d_model]
        tensors = {"W_enc": tensors.pop("w_enc").T, "W_dec": tensors.pop("w_dec"),
                   _THRESHOLD: tensors.pop("threshold"), **tensors}
        if "affine_skip_connection" in tensors:
            tensors["W_skip"] = tensors.pop("affine_skip_connection").T.contiguous()
        recorded: str | None = "latent_rows"
    else:
        recorded = _metadata(file).get(LAYOUT_METADATA_KEY)
    missing = sorted({"W_enc", "W_dec", "b_enc", "b_dec"} - set(tensors))
    if missing or any(tensors[name].dim() != 1 for name in ("b_enc", "b_dec")) or tensors["W_enc"].dim() != 2:
        raise DictionaryLoadError(f"{file}: a circuit-tracer transcoder holds W_enc [d_sae, d_model], W_dec, b_enc "
                                  f"[d_sae] and b_dec [d_model] (missing {missing}, names {sorted(tensors)}); {_FIX}")
    if "log_thresholds" in tensors:
        raise DictionaryLoadError(f"{file}: 'log_thresholds' is a JumpReLU parametrisation circuit-tracer refuses too; "
                                  f"store 'activation_function.threshold' = exp(log_thresholds) instead")
    d_sae, d_model = tensors["b_enc"].shape[0], tensors["b_dec"].shape[0]
    if tuple(tensors["W_enc"].shape) != (d_sae, d_model):
        raise DictionaryLoadError(f"{file}: 'W_enc' has shape {tuple(tensors['W_enc'].shape)}, but b_enc [{d_sae}] "
                                  f"and b_dec [{d_model}] need ({d_sae}, {d_model}): the widths do not fit; {_FIX}")
    if tensors["W_dec"].dim() != 2:
        raise DictionaryLoadError(f"{file}: 'W_dec' is {tensors['W_dec'].dim()}-d, not 2-d; {_FIX}")
    decided = _decoder_layout(file, tensors["W_dec"], d_sae, d_model, recorded, layout)
    kind = "skip_transcoder" if "W_skip" in tensors else "transcoder"
    activation = "jumprelu" if _THRESHOLD in tensors else "relu"
    config = DictionaryConfig(kind, activation, d_model, d_sae, input_node=input_node, output_node=output_node)
    ours = {"W_enc": tensors.pop("W_enc").T.contiguous(), **tensors}
    if decided == "latent_columns":
        ours["W_dec"] = ours["W_dec"].T.contiguous()
    if _THRESHOLD in ours:
        ours["threshold"] = ours.pop(_THRESHOLD)
    return dictionary_from_tensors(config, ours, str(file), _FIX)


def circuit_tracer_tensors(layer: int, transcoder: SparseDictionary,
                           skip: bool) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors and safetensors metadata of circuit-tracer 0.5.0's file for ``transcoder`` (module docstring:
    ``W_dec`` ``[d_sae, d_model]``, recorded as ``decoder_layout: latent_rows``), on the CPU in its dtype.

    Args:
        layer: the layer it is for (named in errors).
        transcoder: a ReLU or JumpReLU transcoder (or skip transcoder) with ``d_in == d_out``.
        skip: write ``W_skip`` (zeros for a plain transcoder: a set whose other layers have one).

    Raises:
        DictionaryConfigError: an SAE, another activation, or ``d_in != d_out``.
    """
    config = transcoder.config
    if config.kind == "sae" or config.activation not in ("relu", "jumprelu") or config.d_in != config.d_out:
        raise DictionaryConfigError(f"layer {layer}: circuit-tracer's transcoder files hold ReLU or JumpReLU "
                                    f"transcoders with d_in == d_out, not a {config.kind} with activation "
                                    f"{config.activation}, d_in={config.d_in}, d_out={config.d_out}")
    state = {name: t.detach().cpu() for name, t in transcoder.state_dict().items()}
    tensors = {"W_enc": state["W_enc"].T.contiguous(), "W_dec": state["W_dec"].contiguous(),
               "b_enc": state["b_enc"].contiguous(), "b_dec": state["b_dec"].contiguous()}
    if config.activation == "jumprelu":
        tensors[_THRESHOLD] = state["threshold"].contiguous()
    if skip:
        tensors["W_skip"] = state.get("W_skip", torch.zeros(config.d_in, config.d_in,
                                                            dtype=state["W_enc"].dtype)).contiguous()
    return tensors, {"format": "pt", LAYOUT_METADATA_KEY: "latent_rows"}
