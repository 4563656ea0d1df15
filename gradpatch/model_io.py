"""What a model takes and gives, whatever wraps it: the model behind a :class:`~gradpatch.PatchableGraph`, the
device and dtype its inputs need, the logits in its output, right- and left-padded token batches, and its parameters
frozen for a block.

General helpers the editors and the recipes share; nothing here knows about edits.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["call_left_padded", "frozen_parameters", "left_pad", "logits_of", "model_device", "model_dtype",
           "pad_token_id", "right_pad", "wrapped_model"]


def wrapped_model(target: nn.Module) -> nn.Module:
    """The model behind a :class:`gradpatch.PatchableGraph` (its parameters are shared), or ``target`` itself."""
    inner = getattr(target, "wrapped_model", None)
    return inner if isinstance(inner, nn.Module) else target


@contextlib.contextmanager
def frozen_parameters(*modules: nn.Module) -> Iterator[None]:
    """Turn off ``requires_grad`` on every parameter of ``modules`` (a PatchableGraph's: its model's) for the block,
    so that autograd keeps only what gradients with respect to activations or patch values need; restore each
    parameter's flag after."""
    params = [p for module in modules for p in wrapped_model(module).parameters()]
    flags = [p.requires_grad for p in params]
    try:
        for p in params:
            p.requires_grad_(False)
        yield
    finally:
        for p, flag in zip(params, flags):
            p.requires_grad_(flag)


def model_device(target: nn.Module) -> torch.device:
    """Where ``target``'s model (a PatchableGraph or a plain model) takes its inputs: the device of its first
    parameter that is not an offloaded (meta) placeholder; CPU if it has none."""
    parameter = next((p for p in wrapped_model(target).parameters() if not p.is_meta), None)
    return torch.device("cpu") if parameter is None else parameter.device


def model_dtype(target: nn.Module) -> torch.dtype:
    """The dtype of ``target``'s first floating-point parameter (a PatchableGraph's or a plain model's); float32 if it
    has none."""
    parameter = next((p for p in wrapped_model(target).parameters() if p.is_floating_point()), None)
    return torch.float32 if parameter is None else parameter.dtype


def logits_of(output: Any) -> torch.Tensor:
    """Extract logits ``[batch, seq, vocab]`` from a model output (``.logits``, ``["logits"]``, tuple or tensor)."""
    if isinstance(output, torch.Tensor):
        return output
    logits = getattr(output, "logits", None)
    if logits is None and isinstance(output, dict):
        logits = output.get("logits")
    if logits is None and isinstance(output, (tuple, list)) and output:
        logits = output[0]
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"Cannot find logits in a {type(output).__name__}: the forward must return logits or .logits")
    return logits


def pad_token_id(tokenizer: Any) -> int:
    """The id used for right padding: the pad token, else EOS, else 0 (pads are never read)."""
    for name in ("pad_token_id", "eos_token_id"):
        value = getattr(tokenizer, name, None)
        if isinstance(value, int):
            return value
    return 0


def right_pad(sequences: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad token id lists into one batch.

    With right padding a causal model needs no attention mask: real tokens never attend to the pads that
    follow them and their position ids are unchanged, so logits at real positions equal the unpadded ones.

    Args:
        sequences: ``batch`` lists of token ids.
        pad_id: id written in the padding.

    Returns:
        ``(input_ids [batch, seq], lengths [batch])``.

    Raises:
        ValueError: ``sequences`` is empty or holds an empty sequence.
    """
    if not sequences or any(len(s) == 0 for s in sequences):
        raise ValueError("right_pad needs at least one non-empty sequence")
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    for i, seq in enumerate(sequences):
        ids[i, : len(seq)] = torch.tensor(list(seq), dtype=torch.long)
    lengths = torch.tensor([len(s) for s in sequences], dtype=torch.long)
    return ids, lengths


def left_pad(sequences: Sequence[Sequence[int]], pad_id: int) -> dict[str, torch.Tensor]:
    """Left-pad token id sequences into a batch.

    Args:
        sequences: ``B`` non-empty sequences of token ids.
        pad_id: id written at padded positions.

    Returns:
        ``input_ids``, ``attention_mask`` (1 on real tokens) and ``position_ids`` (``cumsum(mask) - 1``, 0 on
        padding), each ``[B, S]`` int64 with ``S`` the longest length.
    """
    length = max(len(seq) for seq in sequences)
    ids = torch.full((len(sequences), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), length), dtype=torch.long)
    for i, seq in enumerate(sequences):
        if len(seq):
            ids[i, length - len(seq):] = torch.tensor(list(seq), dtype=torch.long)
            mask[i, length - len(seq):] = 1
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    return {"input_ids": ids, "attention_mask": mask, "position_ids": positions}


def call_left_padded(model: nn.Module, batch: dict[str, torch.Tensor], **kwargs: Any) -> Any:
    """``model``'s output for a left-padded batch (:func:`left_pad`): ``input_ids``, ``attention_mask`` and
    ``position_ids``, each ``[B, S]``, moved to the model's device, with ``kwargs`` as further keyword arguments."""
    device = model_device(model)
    return model(batch["input_ids"].to(device), attention_mask=batch["attention_mask"].to(device),
                 position_ids=batch["position_ids"].to(device), **kwargs)
