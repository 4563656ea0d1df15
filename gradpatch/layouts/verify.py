"""Layouts verified, not guessed: :func:`check_layout` accepts a :class:`~gradpatch.layouts.ModelLayout` for a graph
only when every field it names exists with the shape it promises and the block identities hold on a forward pass;
:func:`detect_layout` returns the first family of the table that passes, or one error naming what failed for each."""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch

from ..errors import LayoutError, NodePathError
from ..patchable_graph import PatchableGraph
from ..patches import CustomPatch, ProbePatch
from .model_layout import ModelLayout
from .table import LAYOUTS

__all__ = ["Problem", "check_layout", "count_layers", "detect_layout", "has_node", "last_position_cut",
           "layout_problems", "logits_input"]

#: Problems found per graph and layout (an empty tuple: the layout holds), so each pair is checked once.
_CHECKED: weakref.WeakKeyDictionary[PatchableGraph, dict[ModelLayout, tuple[str, ...]]] = weakref.WeakKeyDictionary()

#: The block parts that are ``[batch, seq, d_model]`` tensors.
_RESIDUAL_PARTS = ("block_input", "hidden", "attn", "mlp", "mlp_input")
#: The module fields relative to a block.
_MODULE_PARTS = ("attn_norm", "mlp_norm", "attn_post_norm", "mlp_post_norm", "out_projection", "mlp_out", "experts")


def has_node(pg: PatchableGraph, path: str) -> bool:
    """Whether NodePath ``path`` names a node of ``pg`` (a graph, a container or a tensor)."""
    try:
        pg.node(path)
    except NodePathError:
        return False
    return True


def count_layers(pg: PatchableGraph, layout: ModelLayout) -> int:
    """The number of blocks: the first ``i`` for which ``layout.block(i)`` does not exist.

    Raises:
        LayoutError: not even block 0 exists (the message names the NodePath looked for).
    """
    n = 0
    while has_node(pg, layout.block(n)):
        n += 1
    if n == 0:
        raise LayoutError(f"no block {layout.block(0)!r} in this graph: give the pattern of the blocks' NodePaths "
                          f"('{{}}' for the index), e.g. ModelLayout(layer='transformer.h_{{}}') for GPT-2")
    return n


def logits_input(pg: PatchableGraph, layout: ModelLayout | None = None) -> str | None:
    """The unembedding's input NodePath ``[batch, seq, d_model]`` of ``layout`` (default: of any known layout) where
    it exists in ``pg``, else ``None``. Readers of the last position's logits keep that position alone there."""
    candidates = LAYOUTS.values() if layout is None else (layout,)
    return next((c.logits_input for c in candidates if c.logits_input and has_node(pg, c.logits_input)), None)


def last_position_cut() -> CustomPatch:
    """A patch for the unembedding's input (:func:`logits_input`) that keeps its last position alone
    ``[batch, 1, d_model]``: the vocabulary projection then runs once per row, for readers of the last position's
    logits."""
    return CustomPatch(custom_op=_last_position, requires_clone=False)


def _last_position(value: torch.Tensor) -> torch.Tensor:
    return value[:, -1:]


def layout_problems(pg: PatchableGraph, layout: ModelLayout, parts: Iterable[str] | None = None) -> tuple[str, ...]:
    """What does not hold of ``layout`` on ``pg`` (empty: it holds), checked once per graph and layout.

    Checked: every NodePath field exists at every block with its shape (``[batch, seq, d_model]`` residual parts,
    ``[batch, heads, seq, head_dim]`` queries and pattern output, ``[batch, kv_heads, seq, head_dim]`` keys and
    values, ``[batch, seq, heads * head_dim]`` heads), every module field names a module, and on a forward pass of
    the example's size at every block: ``hidden == block_input + attn + mlp``, the attention's norm reads
    ``block_input``, the MLP (its norm where it has one) reads ``block_input + attn`` (sequential) or ``block_input``
    (parallel), the MLP's input is its norm's output, and the heads are the pattern output with its heads merged —
    each within 64 machine epsilons of the terms' magnitude.

    Args:
        parts: the fields a tool relies on (default: all); problems that involve none of them are left out (the
            embeddings and the blocks' pattern always count).
    """
    checked = _CHECKED.setdefault(pg, {})
    if layout not in checked:
        static = _static_problems(pg, layout)
        checked[layout] = tuple(static + _identity_problems(pg, layout, static))
    wanted = None if parts is None else {*parts, "embed", "layer"}
    return tuple(message for involved, message in checked[layout] if wanted is None or involved & wanted)


def check_layout(pg: PatchableGraph, layout: ModelLayout, tool: str = "this tool",
                 parts: Iterable[str] | None = None) -> ModelLayout:
    """``layout`` itself when it holds on ``pg`` (:func:`layout_problems` is empty for ``parts``).

    Raises:
        LayoutError: a field is missing, has another shape or breaks a block identity; the message names each
            problem, and ``tool``.
    """
    problems = layout_problems(pg, layout, parts)
    if problems:
        raise LayoutError(f"the {layout.family!r} layout does not hold on this graph, so {tool} cannot use it: "
                          f"{'; '.join(problems)}. Name this model's NodePaths in a ModelLayout(...) (print pg.graph "
                          f"to find them)")
    return layout


def detect_layout(pg: PatchableGraph) -> ModelLayout:
    """The first layout of the table (:data:`~gradpatch.layouts.LAYOUTS`) that holds on ``pg``
    (:func:`layout_problems`); a family whose embeddings or first block are not in the graph is not tried further.

    Raises:
        LayoutError: no known layout holds; the message names, for each family tried, the NodePaths looked for or the
            fields that failed.
    """
    failures = []
    for name, layout in LAYOUTS.items():
        if not (has_node(pg, layout.embed) and has_node(pg, layout.block(0))):
            failures.append(f"{name}: {layout.embed} and {layout.block(0)}")
            continue
        problems = layout_problems(pg, layout)
        if not problems:
            return layout
        failures.append(f"{name}: {'; '.join(problems[:3])}{' ...' if len(problems) > 3 else ''}")
    raise LayoutError(f"no known model layout fits this graph (looked for {' | '.join(failures)}): name this model's "
                      f"NodePaths in a ModelLayout(embed=..., layer=..., ...) (print pg.graph to find them)")


# --- static checks: NodePaths and shapes ---------------------------------------------------------------------------

#: A problem: the fields it involves, and its message.
Problem = tuple[frozenset[str], str]


def _shape(pg: PatchableGraph, path: str) -> tuple[int, ...] | None:
    """The example's shape of tensor node ``path``; ``None`` where it is missing or not a tensor."""
    try:
        shape = pg.node(path).tensor_shape
    except NodePathError:
        return None
    return None if shape is None else tuple(int(size) for size in shape)


def _heads(pg: PatchableGraph) -> int | None:
    config = getattr(pg, "config", None)
    n = getattr(config, "num_attention_heads", None) or getattr(config, "n_head", None)
    return int(n) if n else None


def _static_problems(pg: PatchableGraph, layout: ModelLayout) -> list[Problem]:
    embed = _shape(pg, layout.embed)
    if embed is None or len(embed) != 3:
        return [(frozenset({"embed"}), f"embed {layout.embed!r} is not a [batch, seq, d_model] tensor")]
    d_model = embed[-1]
    try:
        n_layers = count_layers(pg, layout)
    except LayoutError as error:
        return [(frozenset({"layer"}), str(error))]
    heads = _heads(pg)
    problems: list[Problem] = []
    for layer in range(n_layers):
        block = layout.block(layer)
        for part in _RESIDUAL_PARTS:
            shape = _shape(pg, layout.path(part, layer))
            if shape is None or len(shape) != 3 or shape[-1] != d_model:
                problems.append((frozenset({part}), f"{part} {layout.path(part, layer)!r} is not a "
                                                    f"[batch, seq, {d_model}] tensor (found {shape})"))
        problems += _attention_problems(pg, layout, layer, heads)
        modules = [(part, getattr(layout, part)) for part in _MODULE_PARTS]
        modules += [("projections", projection) for projection in layout.projections or ()]
        for part, module in modules:
            if module is not None and not has_node(pg, f"{block}.{module}"):
                problems.append((frozenset({part}), f"{part} module {f'{block}.{module}'!r} does not exist"))
        for part in ("attn_norm", "mlp_norm"):
            norm = getattr(layout, part)
            if norm is not None and _shape(pg, f"{block}.{norm}.{layout.norm_input}") is None:
                problems.append((frozenset({part, "norm_input"}),
                                 f"norm input {f'{block}.{norm}.{layout.norm_input}'!r} does not exist"))
        problems += _expert_problems(pg, layout, layer)
    if layout.final_norm is not None and not has_node(pg, layout.final_norm):
        problems.append((frozenset({"final_norm"}), f"final_norm module {layout.final_norm!r} does not exist"))
    logits = layout.logits_input
    if logits is not None and (_shape(pg, logits) or (0,))[-1] != d_model:
        problems.append((frozenset({"logits_input"}), f"logits_input {logits!r} is not a [batch, seq, {d_model}] "
                                                      f"tensor"))
    return _first_of_each(problems)


def _first_of_each(problems: list[Problem]) -> list[Problem]:
    """The first problem of each set of fields (the same one at every block is said once)."""
    seen: set[frozenset[str]] = set()
    kept = []
    for involved, message in problems:
        if involved not in seen:
            seen.add(involved)
            kept.append((involved, message))
    return kept


def _attention_problems(pg: PatchableGraph, layout: ModelLayout, layer: int, heads: int | None) -> list[Problem]:
    problems: list[Problem] = []
    found = {part: _shape(pg, layout.path(part, layer)) for part in ("queries", "keys", "values", "pattern_output")
             if getattr(layout, part) is not None}
    for part, shape in found.items():
        query_side = part in ("queries", "pattern_output")
        if shape is None or len(shape) != 4 or (heads is not None and query_side and shape[1] != heads):
            what = f"[batch, {heads or 'heads'}, seq, head_dim]" if query_side else "[batch, kv_heads, seq, head_dim]"
            problems.append((frozenset({part}), f"{part} {layout.path(part, layer)!r} is not a {what} tensor "
                                                f"(found {shape})"))
    query = found.get("queries")
    for part in ("keys", "values"):
        shape = found.get(part)
        if query is not None and shape is not None and len(query) == 4 and len(shape) == 4 and (
                query[1] % shape[1] or shape[2] != query[2] or shape[3] != query[3]):
            problems.append((frozenset({part}), f"{part} {layout.path(part, layer)!r} {shape} is not "
                                                f"[batch, kv_heads, seq, head_dim] beside the queries {query}"))
    width = _shape(pg, layout.path("heads", layer))
    pattern = found.get("pattern_output")
    if width is None or len(width) != 3 or (pattern is not None and len(pattern) == 4
                                             and width[-1] != pattern[1] * pattern[3]):
        problems.append((frozenset({"heads"}), f"heads {layout.path('heads', layer)!r} is not a "
                                               f"[batch, seq, heads * head_dim] tensor (found {width})"))
    return problems


def _expert_problems(pg: PatchableGraph, layout: ModelLayout, layer: int) -> list[Problem]:
    if layout.router_logits is None and layout.expert_choice is None:
        return []
    logits = _shape(pg, layout.path("router_logits", layer))
    choice = _shape(pg, layout.path("expert_choice", layer))
    if logits is None or len(logits) != 2 or choice is None or len(choice) != 2 or choice[0] != logits[0]:
        return [(frozenset({"router_logits", "expert_choice"}),
                 f"router_logits/expert_choice of block {layer} are not [tokens, n_experts] / [tokens, top_k] "
                 f"tensors (found {logits}, {choice})")]
    return []


# --- identities on a forward pass ----------------------------------------------------------------------------------


def _probe_input(pg: PatchableGraph, layout: ModelLayout) -> torch.Tensor:
    """Token ids of the example's ``[batch, seq]`` (1, 2, 3, ... within the vocabulary) on the embeddings' device (the
    example's sizes: no graph is extracted for other sizes)."""
    try:
        weight = pg.original_module(layout.embed_module).weight
    except (NodePathError, AttributeError) as error:
        raise LayoutError(f"the embedding module {layout.embed_module!r} has no weight to verify the layout "
                          f"with") from error
    batch, seq = (_shape(pg, layout.embed) or (1, 1))[:2]
    ids = torch.arange(1, batch * seq + 1) % weight.shape[0]
    return ids.reshape(batch, seq).to(weight.device)


def _close(actual: torch.Tensor, expected: torch.Tensor, *terms: torch.Tensor) -> bool:
    if actual.shape != expected.shape:
        return False
    scale = max(float(t.detach().abs().max()) for t in (actual, *terms)) if actual.numel() else 0.0
    eps = torch.finfo(actual.dtype).eps if actual.dtype.is_floating_point else 0.0
    return float((actual - expected).abs().max()) <= 64 * eps * (1.0 + scale)


def _identity_problems(pg: PatchableGraph, layout: ModelLayout, static: list[Problem]) -> list[Problem]:
    """The block identities, on one forward pass, over the NodePaths the static checks found (an identity whose
    NodePaths are missing is not checked: the static problem already names them)."""
    broken = set().union(*(involved for involved, _ in static)) if static else set()
    if broken & {"embed", "layer"}:
        return []
    n_layers = count_layers(pg, layout)
    wanted: dict[tuple[str, int], str] = {}
    for layer in range(n_layers):
        block = layout.block(layer)
        for part in ("block_input", "hidden", "attn", "mlp", "mlp_input", "heads", "pattern_output"):
            if getattr(layout, part) is not None and part not in broken:
                wanted[part, layer] = layout.path(part, layer)
        for norm in ("attn_norm", "mlp_norm"):
            if getattr(layout, norm) is not None and norm not in broken:
                wanted[norm, layer] = f"{block}.{getattr(layout, norm)}.{layout.norm_input}"
        if layout.mlp_norm is not None and "mlp_norm" not in broken:
            wanted["mlp_norm_output", layer] = f"{block}.{layout.mlp_norm}.output"
    probes = {path: ProbePatch() for path in wanted.values()}
    with torch.no_grad(), pg.patch(probes):
        pg(_probe_input(pg, layout), **_forward_options(pg))
    missing = {key: path for key, path in wanted.items() if probes[path].activation is None}
    if missing:
        return [(frozenset(part for part, _ in missing),
                 f"NodePaths not computed on a forward pass: {', '.join(sorted(set(missing.values())))}")]
    problems: list[Problem] = []
    for layer in range(n_layers):
        seen = {part: probes[path].activation for (part, at), path in wanted.items() if at == layer}
        problems += _block_identities(layout, layer, seen)
    return _first_of_each(problems)


def _block_identities(layout: ModelLayout, layer: int, seen: dict[str, torch.Tensor]) -> list[Problem]:
    """The identities of block ``layer`` among the values ``seen`` there (keys: field names)."""
    problems: list[Problem] = []
    x, attn, mlp, out = (seen.get(part) for part in ("block_input", "attn", "mlp", "hidden"))
    if x is not None and attn is not None and mlp is not None and out is not None \
            and not _close(out, x + attn + mlp, x, attn, mlp):
        error = float((out - (x + attn + mlp)).abs().max())
        problems.append((frozenset({"block_input", "hidden", "attn", "mlp"}),
                         f"block {layer}: hidden != block_input + attn + mlp (off by {error:.3g}): attn and mlp must "
                         f"name what is added to the residual stream"))
    if x is not None and seen.get("attn_norm") is not None and not _close(seen["attn_norm"], x):
        problems.append((frozenset({"attn_norm", "block_input"}),
                         f"block {layer}: the attention's norm {layout.attn_norm!r} does not read block_input"))
    reader_part = "mlp_norm" if layout.mlp_norm is not None else "mlp_input"
    reader = seen.get(reader_part)
    if x is not None and attn is not None and reader is not None:
        expected = x + attn if layout.block_form == "sequential" else x
        if not _close(reader, expected, x, attn):
            reads = "block_input + attn" if layout.block_form == "sequential" else "block_input"
            problems.append((frozenset({reader_part, "block_form", "attn", "mlp"}),
                             f"block {layer}: the MLP ({getattr(layout, reader_part)!r}) does not read {reads} as a "
                             f"{layout.block_form} block does"))
    normed, read = seen.get("mlp_norm_output"), seen.get("mlp_input")
    if normed is not None and read is not None and not _close(read, normed):
        problems.append((frozenset({"mlp_norm", "mlp_input"}),
                         f"block {layer}: the MLP's input {layout.mlp_input!r} is not its norm's "
                         f"({layout.mlp_norm!r}) output"))
    pattern, heads = seen.get("pattern_output"), seen.get("heads")
    if pattern is not None and heads is not None:
        merged = pattern.transpose(1, 2).reshape(pattern.shape[0], pattern.shape[2], -1)
        if not _close(heads, merged):
            problems.append((frozenset({"heads", "pattern_output"}),
                             f"block {layer}: heads is not pattern_output with its heads merged"))
    return problems


def _forward_options(pg: PatchableGraph) -> dict[str, Any]:
    """``use_cache=False`` for models that take it (transformers' causal language models)."""
    return {"use_cache": False} if getattr(pg, "config", None) is not None else {}
