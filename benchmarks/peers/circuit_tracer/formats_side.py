"""circuit-tracer 0.5.0's side of benchmarks/dictionaries/circuit_tracer_files.py, run in its virtualenv (it imports
no gradpatch).

- ``outputs CONFIG``: loads the transcoder set ``CONFIG`` (a ``config.yaml``) twice, with 0.5.0's
  ``utils.hf_utils.load_transcoders`` (the ``transcoders`` list) and with ``utils.caching.load_transcoders_from_cache``
  (the ``layer_<i>.safetensors`` beside it), on the CPU in float32, and writes beside it
  ``circuit_tracer_outputs_<layer>.safetensors``: the inputs ``x`` ``[64, d_model]`` (seed 0), the first loader's
  ``encode(x)`` and ``forward(x)`` (decoder and skip term) and the second's (``cache_latents``, ``cache_forward``).
- ``write FOLDER D_MODEL D_SAE``: builds a two-layer set with circuit-tracer's own classes (``SingleLayerTranscoder``,
  layer 0 JumpReLU, layer 1 ReLU, both with a skip term, random weights, seed 2), saves it with
  ``TranscoderSet.to_safetensors`` and a ``config.yaml`` (0.5.0's cache form: no list), and writes its outputs as
  ``outputs`` does.
- ``decode GRAPH_JSON``: runs ``utils.decode_url_features.decode_url_features`` on a URL whose ``pinnedIds`` are every
  node id of the graph and whose one supernode holds every non-embedding id, and validates the file with the
  frontend's pydantic ``Model``; prints ``{"pinned": {id: [layer, pos, feature]}, "supernode": {...},
  "pydantic_nodes": n}``.

Run (from the repository's root): ``.peers/circuit_tracer/bin/python -m benchmarks.peers.circuit_tracer.formats_side
outputs CONFIG``.
"""

from __future__ import annotations

import json
import sys
import urllib.parse
from pathlib import Path

import torch
import torch.nn.functional as F
import yaml
from safetensors.torch import save_file


def _save_outputs(folder: Path, first, second=None) -> None:
    for layer, transcoder in enumerate(first):
        x = torch.randn(64, transcoder.d_model, generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            tensors = {"x": x, "latents": transcoder.encode(x), "forward": transcoder(x)}
            if second is not None:
                tensors |= {"cache_latents": second[layer].encode(x), "cache_forward": second[layer](x)}
        save_file({name: t.contiguous() for name, t in tensors.items()},
                  str(folder / f"circuit_tracer_outputs_{layer}.safetensors"))


def outputs(config_path: Path) -> None:
    from circuit_tracer.utils.caching import load_transcoders_from_cache
    from circuit_tracer.utils.hf_utils import load_transcoders

    config = yaml.safe_load(config_path.read_text())
    cpu = torch.device("cpu")
    listed = load_transcoders(config, device=cpu, dtype=torch.float32, lazy_encoder=False, lazy_decoder=False)
    cached, _ = load_transcoders_from_cache(config_path.parent.name, cache_dir=config_path.parent.parent, device=cpu,
                                            dtype=torch.float32, lazy_encoder=False, lazy_decoder=False)
    _save_outputs(config_path.parent, listed, cached)


def write(folder: Path, d_model: int, d_sae: int) -> None:
    from circuit_tracer.transcoder.activation_functions import JumpReLU
    from circuit_tracer.transcoder.single_layer_transcoder import SingleLayerTranscoder, TranscoderSet

    generator = torch.Generator().manual_seed(2)
    transcoders = {}
    for layer in range(2):
        activation = JumpReLU(torch.rand(d_sae, generator=generator) * 0.3, 0.1) if layer == 0 else F.relu
        transcoder = SingleLayerTranscoder(d_model, d_sae, activation, layer, skip_connection=True,
                                           device=torch.device("cpu"), dtype=torch.float32)
        with torch.no_grad():
            for name in ("W_enc", "W_dec", "b_enc", "b_dec", "W_skip"):
                parameter = getattr(transcoder, name)
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
        transcoders[layer] = transcoder
    settings = TranscoderSet(transcoders, feature_input_hook="hook_resid_mid", feature_output_hook="hook_mlp_out",
                             scan="circuit-tracer-written")
    settings.to_safetensors(str(folder))
    (folder / "config.yaml").write_text(yaml.safe_dump({
        "model_kind": "transcoder_set", "feature_input_hook": "hook_resid_mid", "feature_output_hook": "hook_mlp_out",
        "scan": "circuit-tracer-written"}))
    _save_outputs(folder, settings)


def decode(graph_json: Path) -> None:
    from circuit_tracer.frontend.graph_models import Model
    from circuit_tracer.utils.decode_url_features import decode_url_features

    document = json.loads(graph_json.read_text())
    ids = [node["node_id"] for node in document["nodes"]]
    members = [node["node_id"] for node in document["nodes"] if node["feature_type"] != "embedding"]
    supernodes = json.dumps([["all", *members]], separators=(",", ":"))
    url = f"https://example.org/graph?pinnedIds={','.join(ids)}&supernodes={urllib.parse.quote(supernodes)}"
    grouped, singles = decode_url_features(url)
    model = Model(**{key: document[key] for key in ("metadata", "qParams", "nodes", "links")})
    print(json.dumps({"pinned": dict(zip(ids, [list(f) for f in singles])),
                      "pinned_count": len(singles),
                      "supernode": dict(zip(members, [list(f) for f in grouped["all"]])),
                      "pydantic_nodes": len(model.nodes)}))


if __name__ == "__main__":
    command, path = sys.argv[1], Path(sys.argv[2])
    if command == "write":
        write(path, int(sys.argv[3]), int(sys.argv[4]))
    else:
        {"outputs": outputs, "decode": decode}[command](path)
