"""circuit-tracer 0.5.0's cross-layer transcoder layout: two safetensors files per layer in one folder.

What ``CrossLayerTranscoder.to_safetensors`` writes and ``load_clt`` / ``_load_state_dict`` read
(``circuit_tracer/transcoder/cross_layer_transcoder.py``), for layers i = 0..L−1, ``L`` being the number of
``W_enc_*.safetensors`` files::

    W_enc_{i}.safetensors   W_enc_{i} [d_sae, d_model]   b_enc_{i} [d_sae]   b_dec_{i} [d_model]
                            threshold_{i} [d_sae]        (JumpReLU only; its absence means ReLU)
    W_dec_{i}.safetensors   W_dec_{i} [d_sae, L − i, d_model]

Its JumpReLU is h · 1[h > θ], as ours. No config file: the hooks read and written are given to its loader, and to
ours as NodePath templates with ``{layer}`` (CLT layer i is model layer i). Its files hold no ``W_skip``
(``to_safetensors`` does not write it, ``_load_state_dict`` does not read it), so a CLT with a skip term cannot be
exported; nor can a TopK CLT (its CLT has ReLU and JumpReLU only) or one with ``d_in != d_out`` (one ``d_model``).
``W_enc`` is transposed to ours ``[L, d_in, m]``; ``W_dec_{i}`` is ours ``W_dec[i]`` as it is, so a CLT read and
exported again holds the same tensors, byte for byte.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from safetensors.torch import save as save_safetensors

from ..files.atomic import atomic_write_bytes, read_tensors
from .clt import CLTConfig, CrossLayerTranscoder
from .clt_files import clt_from_tensors
from .errors import DictionaryConfigError, DictionaryLoadError
from .storage import check_tensors

__all__ = ["export_circuit_tracer_clt", "load_circuit_tracer_clt"]

_FIX = "give a folder as circuit-tracer's CrossLayerTranscoder.to_safetensors writes it"
_FILE = re.compile(r"W_(enc|dec)_(\d+)\.safetensors")


def _layer_files(folder: Path) -> int:
    """The number of layers ``L`` of the CLT in ``folder``.

    Raises:
        DictionaryLoadError: no such folder, no ``W_enc_0.safetensors``, or the encoder and decoder files are not
            both exactly layers 0..L−1 (a missing decoder block, a gap, a stray file).
    """
    if not folder.is_dir():
        raise DictionaryLoadError(f"{folder} is not a folder; {_FIX}")
    found: dict[str, set[int]] = {"enc": set(), "dec": set()}
    for path in folder.iterdir():
        match = _FILE.fullmatch(path.name)
        if match:
            found[match.group(1)].add(int(match.group(2)))
    if not found["enc"]:
        raise DictionaryLoadError(f"{folder} holds no W_enc_*.safetensors; {_FIX}")
    n_layers = len(found["enc"])
    expected = set(range(n_layers))
    for kind, layers in found.items():
        if layers != expected:
            raise DictionaryLoadError(
                f"{folder}: circuit-tracer reads {n_layers} layers (one W_enc_*.safetensors each), so it needs "
                f"W_{kind}_0..{n_layers - 1}.safetensors; missing layers {sorted(expected - layers)}, unexpected "
                f"{sorted(layers - expected)}; {_FIX}")
    return n_layers


def _nodes(template: str, what: str) -> str:
    """``template``, checked to hold ``{layer}``.

    Raises:
        DictionaryConfigError: it does not.
    """
    if "{layer}" not in template:
        raise DictionaryConfigError(f"{what} {template!r} has no '{{layer}}' for the layer index, e.g. "
                                    f"'model.layers_{{layer}}.mlp.x'")
    return template


def load_circuit_tracer_clt(folder: str | Path, input_node_template: str,
                            output_node_template: str) -> CrossLayerTranscoder:
    """Read a CLT in circuit-tracer's layout (module docstring).

    Args:
        folder: the folder of ``W_enc_{i}.safetensors`` and ``W_dec_{i}.safetensors``.
        input_node_template: the NodePath CLT layer i reads, with ``{layer}`` for i, e.g.
            ``detect_layout(pg).template("mlp_input")`` (circuit-tracer's ``hook_resid_mid`` is the MLP's input
            before its norm; its ``ln2.hook_normalized`` after it).
        output_node_template: the NodePath it writes, e.g. ``detect_layout(pg).template("mlp")``.

    Returns:
        The CLT (ReLU, or JumpReLU where the files hold thresholds), in the files' dtype.

    Raises:
        DictionaryLoadError: a missing or unreadable folder or file, a missing decoder block or layer, a missing or
            extra tensor, widths that differ between layers, a decoder not ``[d_sae, L − i, d_model]``, NaN or ±inf.
        DictionaryConfigError: a template without ``{layer}``.
    """
    inputs = _nodes(input_node_template, "input_node_template")
    outputs = _nodes(output_node_template, "output_node_template")
    folder = Path(folder)
    n_layers = _layer_files(folder)
    first = read_tensors(folder / "W_enc_0.safetensors", DictionaryLoadError, _FIX)
    if first.get("W_enc_0") is None or first["W_enc_0"].dim() != 2 or first.get("b_dec_0") is None \
            or first["b_dec_0"].dim() != 1:
        raise DictionaryLoadError(f"{folder / 'W_enc_0.safetensors'} has no 2-d 'W_enc_0' [d_sae, d_model] and "
                                  f"1-d 'b_dec_0' [d_model]; {_FIX}")
    d_sae, d_in = first["W_enc_0"].shape
    d_out = int(first["b_dec_0"].shape[0])
    jumprelu = "threshold_0" in first
    widths = f"n_layers={n_layers}, d_sae={d_sae}, d_model={d_in} (from W_enc_0.safetensors)"
    parts: dict[str, list[torch.Tensor]] = {"W_enc": [], "b_enc": [], "b_dec": [], "threshold": []}
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(n_layers):
        path = folder / f"W_enc_{layer}.safetensors"
        encoder = first if layer == 0 else read_tensors(path, DictionaryLoadError, _FIX)
        shapes = {f"W_enc_{layer}": (d_sae, d_in), f"b_enc_{layer}": (d_sae,), f"b_dec_{layer}": (d_out,)}
        if jumprelu:
            shapes[f"threshold_{layer}"] = (d_sae,)
        check_tensors(encoder, shapes, str(path), _FIX, f"layer {layer}'s encoder file of a "
                      f"{'JumpReLU' if jumprelu else 'ReLU'} CLT (as W_enc_0.safetensors)", widths)
        for name in parts:
            if name != "threshold" or jumprelu:
                parts[name].append(encoder[f"{name}_{layer}"])
        path = folder / f"W_dec_{layer}.safetensors"
        decoder = read_tensors(path, DictionaryLoadError, _FIX)
        check_tensors(decoder, {f"W_dec_{layer}": (d_sae, n_layers - layer, d_out)}, str(path), _FIX,
                      f"layer {layer}'s decoder file", widths)
        tensors[f"W_dec.{layer}"] = decoder[f"W_dec_{layer}"]
    tensors.update({name: torch.stack(values) for name, values in parts.items() if values})
    tensors["W_enc"] = tensors["W_enc"].transpose(1, 2).contiguous()
    config = CLTConfig("jumprelu" if jumprelu else "relu", n_layers, int(d_in), int(d_sae), d_out,
                       input_nodes=[inputs.format(layer=layer) for layer in range(n_layers)],
                       output_nodes=[outputs.format(layer=layer) for layer in range(n_layers)])
    return clt_from_tensors(config, tensors, str(folder), _FIX)


def export_circuit_tracer_clt(clt: CrossLayerTranscoder, folder: str | Path) -> Path:
    """Write ``clt`` in circuit-tracer's layout (module docstring), each file atomically; everything is checked
    before the first file is written.

    Args:
        clt: a ReLU or JumpReLU CLT without a skip term, ``d_in == d_out``, covering model layers 0..L−1.
        folder: the folder (created if missing); it must not hold circuit-tracer files of layers ≥ L (circuit-tracer
            counts the ``W_enc_*`` files to find L).

    Returns:
        ``folder``.

    Raises:
        DictionaryConfigError: a TopK CLT, one with a skip term, ``d_in != d_out``, ``config.layers`` other than
            0..L−1, or a folder holding files of more layers.
        DictionaryLoadError: a tensor holds NaN or ±inf (nothing is written).
    """
    config, folder = clt.config, Path(folder)
    n_layers = config.n_layers
    if config.activation not in ("relu", "jumprelu") or config.skip or config.d_in != config.d_out:
        raise DictionaryConfigError(f"circuit-tracer's CLT files hold ReLU or JumpReLU CLTs without a skip term and "
                                    f"with one d_model, not activation={config.activation}, skip={config.skip}, "
                                    f"d_in={config.d_in}, d_out={config.d_out}")
    if config.layers != list(range(n_layers)):
        raise DictionaryConfigError(f"circuit-tracer's CLT layer i is model layer i, but this CLT covers model layers "
                                    f"{config.layers}; export a CLT over layers 0..L-1")
    stale = sorted(path.name for path in folder.glob("W_*_*.safetensors") if (match := _FILE.fullmatch(path.name))
                   and int(match.group(2)) >= n_layers) if folder.is_dir() else []
    if stale:
        raise DictionaryConfigError(f"{folder} holds {stale}, which circuit-tracer would read as more layers than "
                                    f"this CLT's {n_layers}; export into an empty folder")
    state = {name: tensor.detach().cpu() for name, tensor in clt.state_dict().items()}
    bad = sorted(name for name, tensor in state.items() if not bool(torch.isfinite(tensor).all()))
    if bad:
        raise DictionaryLoadError(f"CLT tensors {bad} hold NaN or ±inf; nothing was written")
    files: dict[str, bytes] = {}
    for layer in range(n_layers):
        encoder = {f"W_enc_{layer}": state["W_enc"][layer].T, f"b_enc_{layer}": state["b_enc"][layer],
                   f"b_dec_{layer}": state["b_dec"][layer]}
        if config.activation == "jumprelu":
            encoder[f"threshold_{layer}"] = state["threshold"][layer]
        files[f"W_enc_{layer}.safetensors"] = save_safetensors({k: v.contiguous() for k, v in encoder.items()})
        files[f"W_dec_{layer}.safetensors"] = save_safetensors({f"W_dec_{layer}": state[f"W_dec.{layer}"].contiguous()})
    for name, data in files.items():
        atomic_write_bytes(folder / name, data)
    return folder
