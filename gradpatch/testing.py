"""Tiny tokenizers and models for trying editors offline (and for the test suite).

Two tokenizer styles cover the differences that subject/target location must survive:

- :func:`byte_level_tokenizer` — GPT-2 style byte-level BPE: no BOS, the space belongs to the next token
  (``"ĠTower"``);
- :func:`metaspace_tokenizer` — Llama/SentencePiece style: a BOS token ``<s>`` is prepended and spaces become
  ``"▁"``.

Both are trained in memory on a few sentences (no download) and wrapped as ``PreTrainedTokenizerFast``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .attribution.prompts import PromptBatch

__all__ = ["FAMILIES", "TOY_FACTS", "TOY_SENTENCES", "CountingBackend", "byte_level_tokenizer", "metaspace_tokenizer",
           "random_prompt_batch", "tiny_causal_lm", "tiny_gpt2", "tiny_llama"]

TOY_FACTS: tuple[tuple[str, str, str, str], ...] = (
    ("The Eiffel Tower is located in the city of", "Eiffel Tower", "Paris", "Rome"),
    ("The capital of France is", "France", "Paris", "London"),
    ("The Colosseum is located in the city of", "Colosseum", "Rome", "Paris"),
)

TOY_SENTENCES: tuple[str, ...] = (
    "The Eiffel Tower is located in the city of Paris.",
    "The Colosseum is located in the city of Rome.",
    "The capital of France is Paris. The capital of Italy is Rome.",
    "London is a large city. Berlin is the capital of Germany.",
    "Therefore I think you know the answer. Because it rains, we stay home.",
    "The official language of Spain is Spanish, and people in Madrid speak it.",
    "Microsoft was founded by Bill Gates. Apple was founded by Steve Jobs.",
    "The river flows into the sea near the old town with a tower and a bridge.",
)


def _train(pre_tokenizer: Any, decoder: Any, texts: Sequence[str], vocab_size: int, specials: list[str],
           alphabet: list[str]) -> Any:
    from tokenizers import Tokenizer, models, trainers

    tokenizer = Tokenizer(models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizer
    tokenizer.decoder = decoder
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, initial_alphabet=alphabet,
                                  show_progress=False)
    tokenizer.train_from_iterator(list(texts), trainer=trainer)
    return tokenizer


def byte_level_tokenizer(texts: Sequence[str] = TOY_SENTENCES, vocab_size: int = 400) -> Any:
    """A GPT-2 style byte-level BPE tokenizer (no BOS; ``<|endoftext|>`` as EOS and pad)."""
    from tokenizers import decoders, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = _train(pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel(), texts, vocab_size,
                 ["<|endoftext|>"], pre_tokenizers.ByteLevel.alphabet())
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")


def metaspace_tokenizer(texts: Sequence[str] = TOY_SENTENCES, vocab_size: int = 300) -> Any:
    """A Llama style tokenizer: ``▁`` for spaces, ``<s>`` prepended to every text, ``</s>`` as EOS/pad."""
    from tokenizers import decoders, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(set("".join(texts)) | {"▁"})
    tok = _train(pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first"),
                 decoders.Metaspace(replacement="▁", prepend_scheme="first"), texts, vocab_size,
                 ["<s>", "</s>", "<unk>"], alphabet)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="</s>",
                                   unk_token="<unk>")


def tiny_llama(vocab_size: int, seed: int = 0, hidden: int = 32, intermediate: int = 64, layers: int = 2,
               init_std: float = 0.3, **config: Any) -> Any:
    """A randomly initialised ``LlamaForCausalLM`` (eval mode, float32): the one builder of tiny Llama models for the
    tests, benchmarks and :func:`recipes.testing.tiny_backbone`.

    ``init_std`` is larger than transformers' 0.02 so that the random model has peaked next-token
    distributions that an edit can visibly move (at 0.02 a 32-wide model is nearly uniform). Seeds torch's global
    generator with ``seed`` (as ``torch.manual_seed``) before drawing the weights.

    Args:
        vocab_size: the vocabulary (the tokenizer's ``len``).
        seed: seed of the weights.
        hidden: ``d_model``; ``intermediate``: the MLP width; ``layers``: decoder layers (4 heads, 2 KV heads).
        init_std: standard deviation of the initial weights.
        **config: other ``LlamaConfig`` fields (defaults: 256 positions, pad/BOS/EOS token id 0).
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    settings: dict[str, Any] = {"num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
                                "pad_token_id": 0, "bos_token_id": 0, "eos_token_id": 0, **config}
    torch.manual_seed(seed)
    model_config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=intermediate,
                               num_hidden_layers=layers, initializer_range=init_std, **settings)
    return LlamaForCausalLM(model_config).eval()


def tiny_gpt2(vocab_size: int, seed: int = 0, hidden: int = 32, layers: int = 2, init_std: float = 0.3,
              **config: Any) -> Any:
    """A randomly initialised ``GPT2LMHeadModel`` (eval mode, float32; MLP ``c_proj`` is a ``Conv1D``): the one
    builder of tiny GPT-2 models.

    Args:
        vocab_size, seed, hidden, layers, init_std: as :func:`tiny_llama` (4 heads).
        **config: other ``GPT2Config`` fields (defaults: 256 positions, BOS/EOS token id 0).
    """
    from transformers import GPT2Config, GPT2LMHeadModel

    settings: dict[str, Any] = {"n_head": 4, "n_positions": 256, "bos_token_id": 0, "eos_token_id": 0, **config}
    torch.manual_seed(seed)
    model_config = GPT2Config(vocab_size=vocab_size, n_embd=hidden, n_layer=layers, initializer_range=init_std,
                              **settings)
    return GPT2LMHeadModel(model_config).eval()


def random_prompt_batch(rows: int = 3, seq: int = 6, seed: int = 0, vocab_size: int = 100) -> PromptBatch:
    """Random clean and corrupted prompts ``[rows, seq]`` with answer and foil ids ``[rows]`` (token ids 3 to
    ``vocab_size - 1``), a :class:`~gradpatch.attribution.prompts.PromptBatch` for attribution on the tiny models."""
    from .attribution.prompts import PromptBatch

    g = torch.Generator().manual_seed(seed)
    return PromptBatch(*(torch.randint(3, vocab_size, shape, generator=g)
                         for shape in ((rows, seq), (rows, seq), (rows,), (rows,))))


#: Tiny configurations of the causal language-model families of transformers the architecture matrix runs: family name
#: -> (config class, model class, that family's own config fields). :func:`tiny_causal_lm` adds the common sizes.
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 8}),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  {"head_dim": 8, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"head_dim": 8, "sliding_window": 4}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {"head_dim": 8, "sliding_window": 4}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {}),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", {}),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", {}),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
    "falcon": ("FalconConfig", "FalconForCausalLM", {}),
    "stablelm": ("StableLmConfig", "StableLmForCausalLM", {}),
    "gptj": ("GPTJConfig", "GPTJForCausalLM", {"rotary_dim": 4}),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", {"head_dim": 8, "num_local_experts": 4, "num_experts_per_tok": 2}),
    "cohere": ("CohereConfig", "CohereForCausalLM", {}),
    "granite": ("GraniteConfig", "GraniteForCausalLM", {"residual_multiplier": 0.5, "embedding_multiplier": 2.0,
                                                        "logits_scaling": 4.0, "attention_multiplier": 0.2}),
}


def tiny_causal_lm(family: str, vocab_size: int = 100, seed: int = 0, hidden: int = 32, layers: int = 2,
                   **config: Any) -> Any:
    """A randomly initialised causal language model of ``family`` (a key of :data:`FAMILIES`; eval mode, float32):
    ``hidden`` wide, ``layers`` blocks, 4 query heads over 2 key/value heads (where the family has them), an MLP twice
    as wide, 64 positions, pad/BOS/EOS token id 0, transformers' own initialisation. Seeds torch's global generator
    with ``seed`` before drawing the weights.

    Raises:
        KeyError: ``family`` is not a key of :data:`FAMILIES` (the message lists them).
    """
    import transformers

    if family not in FAMILIES:
        raise KeyError(f"unknown family {family!r}: choose one of {', '.join(FAMILIES)}")
    config_name, model_name, own = FAMILIES[family]
    sizes = {"vocab_size": vocab_size, "hidden_size": hidden, "intermediate_size": 2 * hidden,
             "num_hidden_layers": layers, "num_attention_heads": 4, "num_key_value_heads": 2,
             "max_position_embeddings": 64, "n_embd": hidden, "n_layer": layers, "n_head": 4, "n_positions": 64,
             "pad_token_id": 0, "bos_token_id": 0, "eos_token_id": 0}
    model_config = getattr(transformers, config_name)(**{**sizes, **own, **config})
    torch.manual_seed(seed)
    return getattr(transformers, model_name)(model_config).eval()


class CountingBackend:
    """A ``torch.compile`` backend that counts the graphs dynamo hands it and runs them unchanged: a test reads
    ``graphs`` to tell compiled calls from eager ones (``pg.compile(backend=CountingBackend())``)."""

    def __init__(self) -> None:
        self.graphs = 0

    def __call__(self, graph_module: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        self.graphs += 1
        return graph_module.forward
