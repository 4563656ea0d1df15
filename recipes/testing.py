"""Tiny random causal LMs with a word-level tokenizer, for tests, benchmarks and smoke runs of the recipes.

Nothing is downloaded: the tokenizer is built in memory from :data:`WORDS` and the model is a randomly initialised
2-layer Llama (hidden size 64, :func:`gradpatch.testing.tiny_llama`) seeded for reproducibility.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from gradpatch.testing import tiny_llama

__all__ = ["WORDS", "save_tiny_backbone", "save_tiny_transcoders", "tiny_backbone", "tiny_tokenizer"]

#: The tiny tokenizer's vocabulary after its special tokens (``<pad>`` 0, ``<unk>`` 1, ``<eos>`` 2).
WORDS: tuple[str, ...] = tuple(
    "the a an of in on to is was and it city tower located capital country river The Eiffel Tower Rome Paris London "
    "Berlin Madrid France Italy Germany Spain I you we feel happy sad great terrible good bad movie weather today "
    "was very not my day food music friend house car dog cat red blue green big small one two three".split())


def tiny_tokenizer() -> Any:
    """A word-level ``PreTrainedTokenizerFast`` over :data:`WORDS` (split on whitespace; spaces are dropped, so
    ``" Rome"`` and ``"Rome"`` are the same single token; decoding joins words with spaces)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<unk>": 1, "<eos>": 2}
    for word in WORDS:
        vocab.setdefault(word, len(vocab))
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", unk_token="<unk>",
                                   eos_token="<eos>")


def tiny_backbone(seed: int = 0, layers: int = 2) -> tuple[nn.Module, Any]:
    """``(model, tokenizer)``: a random ``LlamaForCausalLM`` (hidden 64, MLP 128, 4 heads) in ``eval()`` mode whose
    vocabulary is the tiny tokenizer's.

    Args:
        seed: seed of the weights (same seed, same model, in every process).
        layers: number of decoder layers (NodePaths ``model.layers_0`` ... ``model.layers_{layers-1}``).
    """
    tokenizer = tiny_tokenizer()
    with torch.random.fork_rng(devices=[]):  # leave the caller's random numbers as they were
        model = tiny_llama(len(tokenizer), seed=seed, hidden=64, intermediate=128, layers=layers, init_std=0.02,
                           max_position_embeddings=128, pad_token_id=tokenizer.pad_token_id,
                           eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    return model, tokenizer


def save_tiny_backbone(directory: str | Path, seed: int = 0, layers: int = 2) -> Path:
    """Save :func:`tiny_backbone` with ``save_pretrained`` (model and tokenizer) into ``directory``, a model path
    that ``gradpatch.files.loaders.load_model`` and ``gradpatch fit --model`` accept.

    Returns:
        ``directory``.
    """
    directory = Path(directory)
    model, tokenizer = tiny_backbone(seed, layers)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def save_tiny_transcoders(directory: str | Path, model: nn.Module, seed: int = 0) -> Path:
    """Random ReLU skip transcoders (64 latents, seed ``seed``) at both MLPs of the tiny backbone ``model``, saved
    with its fingerprint as ``directory/layer_0`` and ``directory/layer_1`` (what ``gradpatch circuit
    --dictionaries`` reads).

    Returns:
        ``directory``.
    """
    from gradpatch.dictionaries import SkipTranscoder, save_dictionary

    directory = Path(directory)
    generator = torch.Generator().manual_seed(seed)
    for layer in range(2):
        transcoder = SkipTranscoder(64, 64, activation="relu", input_node=f"model.layers_{layer}.mlp.x",
                                    output_node=f"model.layers_{layer}.mlp.output", generator=generator)
        save_dictionary(transcoder, directory / f"layer_{layer}", model=model)
    return directory
