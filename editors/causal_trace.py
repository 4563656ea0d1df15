"""Causal tracing: where in the network a model recalls a fact (Meng et al. 2022, arXiv 2202.05262, section 2).

The method (paper section 2.1, Figure 1):

1. **Clean run.** Run the prompt (e.g. "The Eiffel Tower is located in the city of") and record every hidden
   state, MLP output and attention output; the answer ``o`` is the first token of the clean greedy
   prediction (" Paris") unless one is given. ``P[o]`` is the *clean probability*.
2. **Corrupted run.** Add Gaussian noise ``ε ~ N(0, ν²)`` to the embeddings of the subject's tokens
   ("The Eiffel Tower"), with ``ν = noise_level × σ`` (``noise_level = 3`` as in the paper) and ``σ`` the
   standard deviation of the embeddings. ``P*[o]``, averaged over ``samples`` noise draws, is the
   *corrupted baseline*.
3. **Corrupted-with-restoration runs.** For every layer ``l`` and token ``i``, rerun the corrupted input but
   force one state back to its clean value: the hidden state after layer ``l`` at token ``i`` (kind
   ``"hidden"``), or the MLP outputs (``"mlp"``) or attention outputs (``"attn"``) at token ``i`` of the
   layers in a window centred on ``l``. ``P*_clean(h_i^l)[o]`` is the probability recovered by restoring that
   state; its excess over the corrupted baseline is the *indirect effect* of the state.

Everything is built from the patch engine: :class:`~gradpatch.ProbePatch` records the clean states,
:class:`~gradpatch.AddPatch` adds the noise at the embedding node and :class:`~gradpatch.ReplacePatch` writes
the clean states back. Restorations are batched: each forward pass holds many ``(layer, token, noise sample)``
rows, each row restoring its own ``(layer, token)`` through one advanced-index ``ReplacePatch`` per node.

Noise scale. ``σ`` defaults to the standard deviation of all entries of the input-embedding matrix
(``noise_std_source = "embedding_matrix"``). The paper's code measures it instead over the embeddings of the
subject tokens of its dataset of known facts; :func:`corpus_embedding_std` measures it over any list of
texts in the same way, and ``noise_std=`` takes either number.

Noise draws. As in the paper's reference code, the ``samples`` noise draws are sampled once (seeded) and reused
for the corrupted baseline and for every restoration, so all cells of the heatmap compare like with like.

Model families. NodePaths come from a :class:`ModelPaths` (Llama defaults, ``GPT2_PATHS`` for GPT-2)::

    Llama / Mistral / Qwen / SmolLM2          GPT-2
    embed  model.embed_tokens.output          transformer.wte.output
    layer  model.layers_{}                    transformer.h_{}
    hidden model.layers_{}.output             transformer.h_{}.output
    mlp    model.layers_{}.mlp.output         transformer.h_{}.mlp.output
    attn   model.layers_{}.self_attn.output|sub_0   transformer.h_{}.attn.output|sub_0
    logits_input  lm_head.input                     lm_head.input

Example::

    from gradpatch import PatchableGraph
    from editors.causal_trace import causal_trace, save_trace

    pg = PatchableGraph(model, ids.expand(2, -1), use_cache=False)   # a batch-2 example: no re-extraction
    result = causal_trace(pg, tokenizer, "{} is located in the city of", "The Eiffel Tower")
    save_trace(result, "runs/trace")            # trace.json + trace_hidden.png, trace_mlp.png, trace_attn.png
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gradpatch import AddPatch, CustomPatch, PatchableGraph, ProbePatch, ReplacePatch

from .errors import EditError, SubjectNotFoundError, TokenizationError
from .layers import model_device
from .tokens import encode_prompt_target, format_with_span, subject_char_span

__all__ = [
    "DEFAULT_WINDOWS",
    "GPT2_PATHS",
    "KINDS",
    "LLAMA_PATHS",
    "KindTrace",
    "ModelPaths",
    "TraceError",
    "TraceResult",
    "causal_trace",
    "corpus_embedding_std",
    "detect_model_paths",
    "embedding_matrix_std",
    "layer_window",
    "log_trace_to_tensorboard",
    "save_trace",
    "subject_token_range",
]

#: The state kinds that can be restored.
KINDS: tuple[str, ...] = ("hidden", "mlp", "attn")

#: Layers restored at once per kind (paper section 2.1: 10-layer windows for MLP and attention outputs).
DEFAULT_WINDOWS: dict[str, int] = {"hidden": 1, "mlp": 10, "attn": 10}


class TraceError(EditError, ValueError):
    """Causal tracing cannot run as asked (unknown kind, bad window, NodePaths that do not fit the model)."""


# --------------------------------------------------------------------------------------------- NodePaths


@dataclass(frozen=True)
class ModelPaths:
    """Where a model family keeps the states causal tracing corrupts and restores.

    Attributes:
        embed: NodePath of the token embeddings ``[batch, seq, d_model]`` (noise is added here). Its module
            (the path without ``.output``) should have a ``weight`` ``[vocab, d_model]`` for the default noise
            scale.
        layer: pattern of a transformer block's NodePath, ``{}`` standing for the layer index.
        hidden: NodePath of the hidden state after a block, relative to ``layer``.
        mlp: NodePath of a block's MLP output, relative to ``layer``.
        attn: NodePath of a block's attention output (a tensor, so dig into tuples), relative to ``layer``.
        logits_input: NodePath of the unembedding's input ``[batch, seq, d_model]``, or ``None``. Only the last
            position's logits are read, so a patch there keeps the last position alone and the vocabulary
            projection runs once per row instead of once per token (for SmolLM2, 49152 x 576: a fifth of the
            FLOPs of a 10-token prompt). Skipped when the node does not exist.
    """

    embed: str = "model.embed_tokens.output"
    layer: str = "model.layers_{}"
    hidden: str = "output"
    mlp: str = "mlp.output"
    attn: str = "self_attn.output|sub_0"
    logits_input: str | None = "lm_head.input"

    def node(self, kind: str, layer: int) -> str:
        """The NodePath of state ``kind`` at ``layer``, e.g. ``node("mlp", 3) == "model.layers_3.mlp.output"``.

        Raises:
            TraceError: unknown ``kind``.
        """
        if kind not in KINDS:
            raise TraceError(f"Unknown kind {kind!r}: choose among {', '.join(KINDS)}")
        return f"{self.layer.format(layer)}.{getattr(self, kind)}"

    @property
    def embed_module(self) -> str:
        """NodePath of the embedding module (``embed`` without its final ``.output``)."""
        return self.embed[: -len(".output")] if self.embed.endswith(".output") else self.embed


#: Llama-style models (Llama, Mistral, Qwen2, SmolLM2): the defaults of :class:`ModelPaths`.
LLAMA_PATHS = ModelPaths()

#: GPT-2 (noise goes on the token embeddings ``wte`` only, not on the position embeddings, as in the paper).
GPT2_PATHS = ModelPaths(
    embed="transformer.wte.output", layer="transformer.h_{}", hidden="output", mlp="mlp.output",
    attn="attn.output|sub_0", logits_input="lm_head.input",
)

_PRESETS: dict[str, ModelPaths] = {"llama": LLAMA_PATHS, "gpt2": GPT2_PATHS}


def _find_node(pg: PatchableGraph, path: str) -> Any | None:
    """The ``pg.graph`` node at ``path`` (``.`` and ``|`` walked alike), or ``None`` if there is none."""
    node: Any = pg.graph
    for part in path.replace("|", ".").split("."):
        if not part:
            continue
        try:
            node = getattr(node, part)
        except AttributeError:
            return None
    return node


def detect_model_paths(pg: PatchableGraph) -> ModelPaths:
    """Pick the preset (:data:`LLAMA_PATHS`, :data:`GPT2_PATHS`) whose NodePaths exist in ``pg``.

    Raises:
        TraceError: no preset fits; the message says how to pass a :class:`ModelPaths`.
    """
    for paths in _PRESETS.values():
        if _find_node(pg, paths.embed) is not None and _find_node(pg, paths.node("hidden", 0)) is not None:
            return paths
    raise TraceError(
        "No known model family fits this graph (looked for model.layers_0 / transformer.h_0): pass "
        "paths=ModelPaths(embed=..., layer=..., hidden=..., mlp=..., attn=...) naming its NodePaths "
        "(print pg.graph to find them)"
    )


def _count_layers(pg: PatchableGraph, paths: ModelPaths) -> int:
    """Number of blocks: the first ``i`` for which ``paths.layer.format(i)`` does not exist.

    Raises:
        TraceError: not even layer 0 exists.
    """
    n = 0
    while _find_node(pg, paths.layer.format(n)) is not None:
        n += 1
    if n == 0:
        raise TraceError(
            f"No layer {paths.layer.format(0)!r} in the graph: pass paths=ModelPaths(layer=...) with the pattern of "
            f"the blocks' NodePaths ('{{}}' for the index), e.g. 'transformer.h_{{}}' for GPT-2"
        )
    return n


def _check_node(pg: PatchableGraph, path: str, what: str) -> None:
    """Raise :class:`TraceError` naming the fix if ``path`` is not a tensor node of ``pg``."""
    node = _find_node(pg, path)
    if node is None:
        raise TraceError(
            f"The {what} NodePath {path!r} does not exist in this graph: pass paths=ModelPaths(...) with this "
            f"model's NodePaths (print pg.graph to find them)"
        )
    if node._is_graph or not isinstance(node._shape, torch.Size):
        raise TraceError(
            f"The {what} NodePath {path!r} is not a tensor (it is a graph or a container): name its tensor "
            f"output, e.g. '{path}.output' or '{path}|sub_0'"
        )


def layer_window(center: int, window: int, num_layers: int) -> range:
    """The layers restored together for a heatmap cell at layer ``center`` (paper section 2.1).

    As in the paper's code, a window of ``w`` layers covers ``[center - w // 2, center + ceil(w / 2))``
    clipped to ``[0, num_layers)``: window 10 at layer 12 restores layers 7..16, window 1 layer 12 only.

    Raises:
        TraceError: ``window < 1``.
    """
    if window < 1:
        raise TraceError(f"window must be at least 1 layer, got {window}")
    return range(max(0, center - window // 2), min(num_layers, center - (-window // 2)))


# ------------------------------------------------------------------------------------------ noise scale


def _embedding_module(pg: PatchableGraph, paths: ModelPaths, fix: str = "") -> nn.Module:
    """The input-embedding module at ``paths.embed_module``.

    Raises:
        TraceError: there is none (the message names ``fix`` and ``paths=ModelPaths(embed=...)``).
    """
    try:
        return pg.original_module(paths.embed_module)
    except (KeyError, ValueError) as error:
        raise TraceError(f"Cannot find the embedding module {paths.embed_module!r} ({error}); pass "
                         f"{fix}paths=ModelPaths(embed=...)") from error


def embedding_matrix_std(pg: PatchableGraph, paths: ModelPaths | None = None) -> float:
    """Standard deviation of all entries of the input-embedding matrix ``[vocab, d_model]`` (dimensionless).

    Raises:
        TraceError: the embedding module has no ``weight`` matrix (pass ``noise_std=`` to :func:`causal_trace`).
    """
    module = _embedding_module(pg, paths or detect_model_paths(pg), fix="noise_std= explicitly or ")
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise TraceError(
            f"The embedding module {paths.embed_module!r} has no 2-D weight matrix: pass noise_std= explicitly "
            f"(e.g. from corpus_embedding_std)"
        )
    return float(weight.detach().float().std())


def corpus_embedding_std(
    pg: PatchableGraph, tokenizer: Any, texts: Iterable[str], paths: ModelPaths | None = None
) -> float:
    """Standard deviation of the embeddings of the tokens of ``texts`` (all entries pooled; dimensionless).

    The paper's code measures the noise scale this way over the subjects of its known-facts dataset. Special
    tokens the tokenizer adds (BOS) are left out. The embedding module (``paths.embed`` without ``.output``) is
    called directly on the token ids: token embeddings do not depend on context, so no forward pass is needed.

    Args:
        pg: the PatchableGraph of the model.
        tokenizer: its tokenizer.
        texts: e.g. a list of subjects ``["The Eiffel Tower", "Barack Obama", ...]``.
        paths: NodePaths (auto-detected when ``None``).

    Returns:
        σ over all embedding entries of all tokens.

    Raises:
        TraceError: ``texts`` holds no token, or the embedding module is not found.
    """
    module = _embedding_module(pg, paths or detect_model_paths(pg))
    device = model_device(module)
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    chunks: list[torch.Tensor] = []
    with torch.no_grad():
        for text in texts:
            ids = [t for t in tokenizer(text)["input_ids"] if t not in special]
            if ids:  # embeddings do not depend on context: embed the tokens alone
                chunks.append(module(torch.tensor([ids], device=device)).float().reshape(-1).cpu())
    if not chunks:
        raise TraceError("corpus_embedding_std got no tokens: give a non-empty list of texts")
    return float(torch.cat(chunks).std())


# ------------------------------------------------------------------------------------------- tokens


def subject_token_range(tokenizer: Any, text: str, span: tuple[int, int]) -> tuple[list[int], tuple[int, int]]:
    """Tokenize ``text`` and find the tokens covering the subject's characters ``span``.

    A token belongs to the subject when its character span overlaps ``span`` (so GPT-2's ``" Tower"`` and
    Llama's ``"▁Tower"`` count; a BOS token never does). Slow tokenizers without offsets fall back to
    comparing tokenizations of the text up to the subject's start and end.

    Args:
        tokenizer: a Hugging Face tokenizer.
        text: the full prompt.
        span: ``(start, end)`` characters of the subject in ``text``.

    Returns:
        ``(ids, (first, stop))``: the token ids of ``text`` and the subject's token positions ``[first, stop)``.

    Raises:
        SubjectNotFoundError: no token covers the subject.
    """
    start, end = span
    try:
        enc = tokenizer(text, return_offsets_mapping=True)
        offsets: list[tuple[int, int]] | None = [tuple(o) for o in enc["offset_mapping"]]  # type: ignore[misc]
        ids = list(enc["input_ids"])
    except (NotImplementedError, TypeError, ValueError, KeyError):
        ids, offsets = list(tokenizer(text)["input_ids"]), None
    if offsets is not None:
        special = set(getattr(tokenizer, "all_special_ids", []) or [])
        hits = [i for i, (t, (a, b)) in enumerate(zip(ids, offsets))
                if b > a and a < end and b > start and not (t in special and i == 0)]
    else:
        def common(prefix: str) -> int:
            p = list(tokenizer(prefix)["input_ids"])
            n = 0
            while n < min(len(p), len(ids)) and p[n] == ids[n]:
                n += 1
            return n if n == len(p) else n + 1  # a straddling token counts as inside
        first = common(text[:start]) if start > 0 else common("")
        hits = list(range(min(first, len(ids)), min(common(text[:end]), len(ids))))
    if not hits:
        raise SubjectNotFoundError(
            f"No token of {text!r} covers the subject at characters {span}: check the subject is spelled as in "
            f"the prompt"
        )
    return ids, (hits[0], hits[-1] + 1)


def _prompt_and_span(prompt: str, subject: str) -> tuple[str, tuple[int, int]]:
    """The prompt text with the subject's character span: fills ``"{}"`` or finds the subject's occurrence.

    Raises:
        SubjectNotFoundError: no ``"{}"`` and the subject is not in the prompt (or is empty).
    """
    if "{}" in prompt:
        return format_with_span(prompt, subject)
    return prompt, subject_char_span(prompt, subject)


def _answer_id(tokenizer: Any, text: str, ids: list[int], answer: str | int) -> int:
    """The first token id of ``answer`` as a continuation of ``text`` (a given token id passes through).

    Raises:
        TokenizationError: the answer is empty or does not tokenize as a continuation of the prompt.
    """
    if isinstance(answer, int):
        return answer
    encoded = encode_prompt_target(tokenizer, text, answer)
    if encoded.ids[: encoded.target_start] != ids:
        raise TokenizationError(
            f"The tokens of {text!r} change when {answer!r} follows it: end the prompt at a word boundary, or "
            f"give the answer as a token id"
        )
    return encoded.ids[encoded.target_start]


# ------------------------------------------------------------------------------------------ results


@dataclass
class KindTrace:
    """The restoration heatmap of one state kind.

    Attributes:
        kind: ``"hidden"``, ``"mlp"`` or ``"attn"``.
        window: layers restored at once (a cell at layer ``l`` restores :func:`layer_window` ``(l, window)``).
        node_pattern: the restored NodePath with ``{}`` for the layer, e.g. ``"model.layers_{}.mlp.output"``.
        scores: ``[num_layers, num_tokens]`` probability of the answer token (0..1) after restoring the state
            at (layer window, token), averaged over the noise samples.
    """

    kind: str
    window: int
    node_pattern: str
    scores: torch.Tensor

    def peak(self, token: int | None = None) -> tuple[int, int, float]:
        """``(layer, token, probability)`` of the highest cell (restricted to ``token`` when given)."""
        if token is not None:
            layer = int(self.scores[:, token].argmax())
            return layer, token, float(self.scores[layer, token])
        flat = int(self.scores.argmax())
        layer, tok = divmod(flat, self.scores.shape[1])
        return layer, tok, float(self.scores[layer, tok])


@dataclass
class TraceResult:
    """A causal trace of one prompt (paper section 2.1, Figure 1).

    Attributes:
        prompt: the full prompt text.
        subject: the corrupted subject.
        tokens: the decoded prompt tokens (heatmap labels), length ``num_tokens``.
        subject_range: ``(first, stop)`` token positions of the subject (noise goes on ``[first, stop)``).
        answer: the decoded answer token; ``answer_id`` its id.
        clean_prob: P(answer) on the clean prompt, at the last position.
        corrupted_prob: P(answer) with the subject corrupted, averaged over the noise samples (the baseline).
        noise_std: σ of the embeddings; ``noise_std_source`` says how it was measured
            (``"embedding_matrix"``, ``"corpus"`` or ``"given"``); the noise is ``N(0, (noise_level·σ)²)``.
        samples: number of noise draws; ``seed`` the seed of their generator.
        num_layers: blocks in the model.
        kinds: one :class:`KindTrace` per traced kind.
        seconds: wall time of the trace (forward passes included, model loading not).
    """

    prompt: str
    subject: str
    tokens: list[str]
    token_ids: list[int]
    subject_range: tuple[int, int]
    answer: str
    answer_id: int
    clean_prob: float
    corrupted_prob: float
    noise_std: float
    noise_std_source: str
    noise_level: float
    samples: int
    seed: int
    num_layers: int
    paths: ModelPaths
    kinds: dict[str, KindTrace] = field(default_factory=dict)
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict; each kind's ``scores`` is a nested list ``[num_layers][num_tokens]``."""
        kinds = {}
        last_subject = self.subject_range[1] - 1
        for name, trace in self.kinds.items():
            layer, tok, prob = trace.peak()
            sub_layer, _, sub_prob = trace.peak(last_subject)
            last_layer, _, last_prob = trace.peak(len(self.tokens) - 1)
            kinds[name] = {
                "window": trace.window,
                "node_pattern": trace.node_pattern,
                "scores": [[round(float(v), 7) for v in row] for row in trace.scores],
                "peak": {"layer": layer, "token": tok, "prob": prob},
                "peak_at_last_subject_token": {"layer": sub_layer, "prob": sub_prob},
                "peak_at_last_token": {"layer": last_layer, "prob": last_prob},
            }
        return {
            "prompt": self.prompt,
            "subject": self.subject,
            "tokens": self.tokens,
            "token_ids": self.token_ids,
            "subject_range": list(self.subject_range),
            "answer": self.answer,
            "answer_id": self.answer_id,
            "clean_prob": self.clean_prob,
            "corrupted_prob": self.corrupted_prob,
            "noise": {
                "std": self.noise_std,
                "std_source": self.noise_std_source,
                "level": self.noise_level,
                "scale": self.noise_level * self.noise_std,
                "samples": self.samples,
                "seed": self.seed,
            },
            "num_layers": self.num_layers,
            "paths": asdict(self.paths),
            "scores_layout": "scores[layer][token]: P(answer) after restoring that state, mean over noise samples",
            "kinds": kinds,
            "seconds": self.seconds,
        }


# ------------------------------------------------------------------------------------------- tracing


def _logits(output: Any) -> torch.Tensor:
    """The ``[batch, seq, vocab]`` logits of a model output (``.logits``, first tuple item, or the tensor)."""
    if isinstance(output, torch.Tensor):
        return output
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(output, (tuple, list)) and isinstance(output[0], torch.Tensor):
        return output[0]
    raise TraceError(f"Cannot find logits in a {type(output).__name__} model output: wrap the model so it returns "
                     f"logits [batch, seq, vocab]")


def _keep_last_position(hidden: torch.Tensor) -> torch.Tensor:
    """``[batch, seq, d_model] -> [batch, 1, d_model]``: the only position whose logits causal tracing reads."""
    return hidden[:, -1:]


def _last_logits(pg: PatchableGraph, ids: torch.Tensor, patch_map: dict[str, Any], cut: str | None) -> torch.Tensor:
    """Logits ``[batch, vocab]`` at the last position of ``ids`` ``[batch, seq]`` under ``patch_map``.

    ``cut`` is the unembedding's input NodePath (or ``None``): there the sequence is cut to its last position.
    """
    if cut is not None:
        patch_map = {**patch_map, cut: CustomPatch(custom_op=_keep_last_position)}
    with pg.patch(patch_map):
        logits = _logits(pg(ids, use_cache=False))
    return logits[:, -1, :].float()


def causal_trace(
    pg: PatchableGraph,
    tokenizer: Any,
    prompt: str,
    subject: str,
    *,
    answer: str | int | None = None,
    kinds: Sequence[str] = KINDS,
    samples: int = 10,
    noise_level: float = 3.0,
    noise_std: float | None = None,
    noise_std_source: str | None = None,
    seed: int = 1,
    windows: dict[str, int] | None = None,
    paths: ModelPaths | None = None,
    batch_size: int = 256,
    causal: bool = True,
    progress: Callable[[int, int], None] | None = None,
) -> TraceResult:
    """Trace which states of ``pg``'s model carry the fact ``prompt(subject) -> answer`` (paper section 2.1).

    Args:
        pg: PatchableGraph of a causal LM; build it with a batch-2 example (``ids.expand(2, -1)``) so that no
            forward pass here needs a re-extraction.
        tokenizer: the model's tokenizer (fast tokenizers give character offsets; slow ones work too).
        prompt: the prompt with ``"{}"`` where the subject goes (``"{} is located in the city of"``), or the full
            text containing the subject (its last occurrence is corrupted).
        subject: the subject whose token embeddings are corrupted (``"The Eiffel Tower"``).
        answer: the answer text (its first token is scored, e.g. ``"Paris"`` for ``" Paris"``) or a token id;
            ``None`` uses the clean greedy prediction.
        kinds: which states to restore, among ``"hidden"``, ``"mlp"``, ``"attn"``.
        samples: noise draws averaged over (the paper uses 10).
        noise_level: noise standard deviation in units of the embeddings' σ (the paper's 3).
        noise_std: σ itself; ``None`` measures it over the embedding matrix (:func:`embedding_matrix_std`).
        noise_std_source: label recorded for a given ``noise_std`` (default ``"given"``).
        seed: seed of the noise generator (the draws are shared by all restorations).
        windows: layers restored at once per kind (default :data:`DEFAULT_WINDOWS`: hidden 1, mlp 10, attn 10);
            a cell at layer ``l`` restores the layers :func:`layer_window` ``(l, window, num_layers)``.
        paths: the model's NodePaths (default: detected among :data:`LLAMA_PATHS` and :data:`GPT2_PATHS`).
        batch_size: rows per forward pass (each row is one (layer, token, noise sample) restoration).
        causal: the model attends only to earlier positions, so tokens before the subject are unaffected by the
            noise and restoring them gives exactly the corrupted baseline: those cells are filled in without a
            forward pass. Set ``False`` for models that attend to later positions.
        progress: optional callback ``(rows_done, rows_total)`` after each forward pass.

    Returns:
        A :class:`TraceResult` with ``kinds[kind].scores`` ``[num_layers, num_tokens]``.

    Raises:
        SubjectNotFoundError: the subject is not in the prompt (or the template has no single ``"{}"``).
        TokenizationError: the answer does not tokenize as a continuation of the prompt.
        TraceError: unknown kind, ``samples < 1``, a window below 1, ``batch_size < 2``, ``pg`` in training mode,
            or NodePaths that do not fit the model (the message says to pass ``paths=ModelPaths(...)``).
    """
    t_start = time.perf_counter()
    kinds = list(kinds)
    for kind in kinds:
        if kind not in KINDS:
            raise TraceError(f"Unknown kind {kind!r}: choose among {', '.join(KINDS)}")
    if not kinds:
        raise TraceError(f"No kinds to trace: give some of {', '.join(KINDS)}")
    if samples < 1:
        raise TraceError(f"samples must be at least 1, got {samples}")
    if batch_size < 2:
        raise TraceError(f"batch_size must be at least 2 rows, got {batch_size}")
    windows = {**DEFAULT_WINDOWS, **(windows or {})}
    for kind in kinds:
        if windows[kind] < 1:
            raise TraceError(f"The window of {kind!r} must be at least 1 layer, got {windows[kind]}")

    if pg.training:
        raise TraceError("The model is in training mode (dropout would add its own noise): call pg.eval() first")
    paths = paths or detect_model_paths(pg)
    num_layers = _count_layers(pg, paths)
    _check_node(pg, paths.embed, "embedding")
    for kind in kinds:
        _check_node(pg, paths.node(kind, 0), kind)

    text, span = _prompt_and_span(prompt, subject)
    ids_list, (s0, s1) = subject_token_range(tokenizer, text, span)
    num_tokens = len(ids_list)
    d_model = int(_find_node(pg, paths.embed)._shape[-1])  # type: ignore[union-attr]
    cut = paths.logits_input if paths.logits_input and _find_node(pg, paths.logits_input) is not None else None
    device = next((p.device for p in pg.parameters()), torch.device("cpu"))

    if noise_std is None:
        noise_std, source = embedding_matrix_std(pg, paths), "embedding_matrix"
    else:
        source = noise_std_source or "given"
    generator = torch.Generator().manual_seed(seed)
    noise = torch.randn(samples, s1 - s0, d_model, generator=generator) * (noise_level * noise_std)
    noise = noise.to(device)

    # Clean run (row 0, no noise) and corrupted baseline (rows 1..samples) in one pass, probing every state.
    ids = torch.tensor(ids_list, device=device)
    batch = ids.expand(samples + 1, -1)
    noise_rows = torch.cat([torch.zeros_like(noise[:1]), noise])
    probes: dict[str, ProbePatch] = {paths.node(k, layer): ProbePatch() for k in kinds for layer in range(num_layers)}
    patch_map: dict[str, Any] = {paths.embed: AddPatch(value=noise_rows, slice=(slice(None), slice(s0, s1)))}
    patch_map.update(probes)
    with torch.no_grad():
        probs = torch.softmax(_last_logits(pg, batch, patch_map, cut), dim=-1)
        answer_id = int(probs[0].argmax()) if answer is None else _answer_id(tokenizer, text, ids_list, answer)
        if not 0 <= answer_id < probs.shape[-1]:
            raise TokenizationError(f"Answer token id {answer_id} is outside the vocabulary of {probs.shape[-1]}")
        clean_prob = float(probs[0, answer_id])
        corrupted_prob = float(probs[1:, answer_id].mean())
        clean = {path: probe.activation[0] for path, probe in probes.items()}  # each [seq, d_model]
    del probes, patch_map

    # Restoration rows: (kind, layer, token) jobs x noise samples, cut into batches of at most batch_size rows.
    first_token = s0 if causal else 0
    jobs = [(kind, layer, tok)
            for kind in kinds for layer in range(num_layers) for tok in range(first_token, num_tokens)]
    rows_total = len(jobs) * samples
    row_probs = torch.empty(rows_total)
    row_job = torch.arange(len(jobs)).repeat_interleave(samples)
    row_sample = torch.arange(samples).repeat(len(jobs))
    with torch.no_grad():
        for begin in range(0, rows_total, batch_size):
            end = min(begin + batch_size, rows_total)
            chunk_jobs, chunk_samples = row_job[begin:end].tolist(), row_sample[begin:end]
            if end - begin == 1:  # never run batch 1: a batch-2 example's graphs cover batches >= 2 only
                chunk_jobs, chunk_samples = chunk_jobs * 2, chunk_samples.repeat(2)
            restore: dict[str, tuple[list[int], list[int]]] = {}
            for row, job in enumerate(chunk_jobs):
                kind, center, tok = jobs[job]
                for layer in layer_window(center, windows[kind], num_layers):
                    rows, toks = restore.setdefault(paths.node(kind, layer), ([], []))
                    rows.append(row)
                    toks.append(tok)
            chunk_map: dict[str, Any] = {
                paths.embed: AddPatch(value=noise[chunk_samples.to(device)], slice=(slice(None), slice(s0, s1)))
            }
            for path, (rows, toks) in restore.items():
                index = (torch.tensor(rows, device=device), torch.tensor(toks, device=device))
                chunk_map[path] = ReplacePatch(value=clean[path][index[1]], slice=index)
            logits = _last_logits(pg, ids.expand(len(chunk_jobs), -1), chunk_map, cut)
            result = torch.softmax(logits, dim=-1)[:, answer_id].cpu()
            row_probs[begin:end] = result[: end - begin]
            if progress is not None:
                progress(end, rows_total)

    job_means = row_probs.view(len(jobs), samples).mean(dim=1) if jobs else row_probs
    traces: dict[str, KindTrace] = {}
    for kind in kinds:
        scores = torch.full((num_layers, num_tokens), corrupted_prob)
        pattern = f"{paths.layer}.{getattr(paths, kind)}"
        traces[kind] = KindTrace(kind=kind, window=windows[kind], node_pattern=pattern, scores=scores)
    for job, (kind, layer, tok) in enumerate(jobs):
        traces[kind].scores[layer, tok] = job_means[job]

    tokens = [tokenizer.decode([t]) for t in ids_list]
    return TraceResult(
        prompt=text, subject=subject, tokens=tokens, token_ids=ids_list, subject_range=(s0, s1),
        answer=tokenizer.decode([answer_id]), answer_id=answer_id, clean_prob=clean_prob,
        corrupted_prob=corrupted_prob, noise_std=float(noise_std), noise_std_source=source,
        noise_level=float(noise_level), samples=samples, seed=seed, num_layers=num_layers, paths=paths,
        kinds=traces, seconds=time.perf_counter() - t_start,
    )


# ------------------------------------------------------------------------------------------- outputs


def save_trace(result: TraceResult, out_dir: str | Path, *, model_name: str = "") -> dict[str, Path]:
    """Write ``out_dir/trace.json`` and one heatmap ``out_dir/trace_<kind>.png`` per traced kind.

    Args:
        result: a :class:`TraceResult`.
        out_dir: folder (created if missing).
        model_name: shown in the x-axis label of the heatmaps.

    Returns:
        ``{"json": path, "<kind>": png path, ...}``.
    """
    from .trace_plot import plot_trace

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written: dict[str, Path] = {}
    json_path = out / "trace.json"
    json_path.write_text(json.dumps(result.to_dict(), indent=1))
    written["json"] = json_path
    for kind in result.kinds:
        fig = plot_trace(result, kind, model_name=model_name)
        png = out / f"trace_{kind}.png"
        fig.savefig(png, bbox_inches="tight")
        written[kind] = png
    return written


def log_trace_to_tensorboard(
    result: TraceResult, writer: Any, *, tag: str = "causal_trace", step: int = 0, model_name: str = ""
) -> list[str]:
    """Add a trace's heatmaps (images) and probabilities (scalars) to a TensorBoard run.

    Args:
        result: a :class:`TraceResult`.
        writer: a ``torch.utils.tensorboard.SummaryWriter`` (left open) or a log directory (a writer is opened
            there and closed).
        tag: tag prefix; images go to ``{tag}/{kind}``, scalars to ``{tag}/clean_prob`` and
            ``{tag}/corrupted_prob``, the JSON summary (without score grids) to ``{tag}/summary`` as text.
        step: the global step recorded.
        model_name: shown in the heatmaps' x-axis label.

    Returns:
        The image tags written.

    Raises:
        ImportError: tensorboard is not installed (``pip install tensorboard``).
    """
    from .trace_plot import plot_trace

    own = not hasattr(writer, "add_figure")
    if own:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as error:  # pragma: no cover - depends on the environment
            raise ImportError("Logging a trace to TensorBoard needs tensorboard: pip install tensorboard") from error
        writer = SummaryWriter(log_dir=str(writer))
    tags = []
    try:
        for kind in result.kinds:
            fig = plot_trace(result, kind, model_name=model_name)
            writer.add_figure(f"{tag}/{kind}", fig, global_step=step, close=True)
            tags.append(f"{tag}/{kind}")
        writer.add_scalar(f"{tag}/clean_prob", result.clean_prob, step)
        writer.add_scalar(f"{tag}/corrupted_prob", result.corrupted_prob, step)
        summary = result.to_dict()
        for kind in summary["kinds"].values():
            kind.pop("scores")
        writer.add_text(f"{tag}/summary", "```\n" + json.dumps(summary, indent=1) + "\n```", step)
        writer.flush()
    finally:
        if own:
            writer.close()
    return tags
