"""Model fingerprints: a short hash that tells whether saved interventions and edits belong to a model."""

from __future__ import annotations

import hashlib

import torch
from torch import nn

_SAMPLES = 64


def model_fingerprint(model: nn.Module, skip: tuple[str, ...] = ()) -> str:
    """SHA-256 (first 16 hex digits) over the model class, every parameter's name, shape and dtype, and a strided
    sample of ``_SAMPLES`` values of each parameter (cheap: no full pass over the weights).

    Two loads of the same checkpoint give the same fingerprint; an in-place edit of a sampled weight changes it.
    A weight accelerate offloaded (a meta placeholder) contributes its name, shape and dtype only.

    Args:
        model: the model.
        skip: parameter-name prefixes (dotted, e.g. ``"model.layers.3.mlp.down_proj."``) left out of the hash.
    """
    digest = hashlib.sha256(type(model).__qualname__.encode())
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if skip and name.startswith(skip):
                continue
            digest.update(f"{name}:{tuple(parameter.shape)}:{parameter.dtype}".encode())
            if parameter.is_meta:
                continue
            flat = parameter.detach().reshape(-1)
            step = max(1, flat.numel() // _SAMPLES)
            digest.update(flat[::step][:_SAMPLES].to(torch.float64).cpu().numpy().tobytes())
    return digest.hexdigest()[:16]
