"""Head loadings: an attribution-graph edge split across the attention heads that carry it (Kamath, Ameisen et al.
2025, "Tracing Attention Computation Through Feature Interactions"; the per-layer split of circuit-tracer PR 114,
``head_loadings``).

An edge A[t, s] = g · contribution_s is a sum over the linear paths from source s to target t in the local
replacement model (:mod:`gradpatch.circuits.replacement`; a cross-layer transcoder's feature contributes through its
decoder blocks into every later MLP output, :func:`~gradpatch.circuits.sources.contract_sources`, so its paths start
at each of them): patterns frozen, so an attention layer L acts on its input
as Σ_h A_h V_h W_O,h, one term per head, plus the residual stream that bypasses it. Every path crosses layer L
either through exactly one of its heads or around it, so for each attention layer L on its own

    A[t, s] = bypass_L[t, s] + Σ_h loading_L,h[t, s],

loading_L,h being the paths through head h of layer L (whatever they do at other layers), bypass_L the paths that
do not pass through layer L's attention at all (the residual stream and, where the source is after L or the target
before it, everything). A path through heads of several layers counts at each of them, once per layer; no joint
split across layers is made (one is not well defined: paths compose). For an edge between two positions p' < p,
bypass_L is the share carried by attention at other layers only.

Computation: gradients with a per-row stop-gradient on chosen heads' outputs A·V ``[batch, heads, seq, head_dim]``
(the value does not change: out · m + (out · (1 − m)).detach()). Per target, one row with every head open (the edge
itself), and per attention layer L one row with layer L closed (bypass_L) and one row per head h with only head h of
layer L open (bypass_L + loading_L,h); all rows of one forward pass, one backward pass. Loadings are differences of
rows of the same pass; their sum is the edge by linearity, up to the rounding of the rows. The rows are computed in
float64 whatever the model's dtype (:func:`~gradpatch.circuits.float64.float64_replacement`: the same affine map, its
weights and recorded values converted exactly, the model's own casts to float32 passed over), so that a loading
small beside its rows, or an edge that is a cancellation of larger paths, keeps float64's ~1e-16 of the rows' size
rather than float32's ~1e-7 (rows in float32 missed the tiny GPT-2's edges with |A| > 1e-4 by up to 6.2e-4
relative; in float64, 6e-13); the table is float64.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save as save_safetensors

from ..files.atomic import atomic_write_bytes, atomic_write_text
from ..layouts import last_position_cut, logits_input
from ..model_io import frozen_parameters
from ..patches import CustomPatch, HoldPatch, Patch
from .attention import AttentionSite, find_attention_sites
from .errors import CircuitError
from .float64 import cast_nodes, float64_casts, float64_replacement
from .graph import AttributionGraph
from .replacement import ReplacementModel
from .sources import contract_sources

__all__ = ["BYPASS", "HeadLoadings", "head_loadings", "save_head_loadings"]

#: The head index of a bypass entry in :attr:`HeadLoadings.indices`.
BYPASS = -1


@dataclass
class HeadLoadings:
    """Head loadings of the edges into some targets, as a sparse table.

    Attributes:
        indices: ``[n, 4]`` (target node, source node, attention layer, head; head :data:`BYPASS` for the bypass).
        values: ``[n]`` loading_L,h[t, s] or bypass_L[t, s] (float64, unless computed with ``float64=False``).
        edges: ``[n_edges, 3]`` (target node, source node, edge A[t, s] from the all-open row; same dtype) of every
            edge split; each attention layer's entries of an edge sum to it (to float64 rounding of the rows).
        heads: heads per attention layer.
    """

    indices: torch.Tensor
    values: torch.Tensor
    edges: torch.Tensor
    heads: list[int]

    def edge(self, target: int, source: int) -> dict[int, tuple[torch.Tensor, float]]:
        """Attention layer -> (loadings per head ``[heads]``, bypass) of edge (``target``, ``source``); empty when
        the edge was not split."""
        chosen = (self.indices[:, 0] == target) & (self.indices[:, 1] == source)
        found: dict[int, tuple[torch.Tensor, float]] = {}
        for layer, head, value in zip(self.indices[chosen, 2].tolist(), self.indices[chosen, 3].tolist(),
                                      self.values[chosen].tolist()):
            per_head, bypass = found.get(layer, (torch.zeros(self.heads[layer], dtype=self.values.dtype), 0.0))
            if head == BYPASS:
                bypass = value
            else:
                per_head[head] = value
            found[layer] = (per_head, bypass)
        return found


def _target_gradient(model: ReplacementModel, graph: AttributionGraph, run_inputs: dict[int, torch.Tensor],
                     logits: torch.Tensor, targets: Sequence[int], rows_per: int) -> tuple[list[torch.Tensor],
                                                                                           list[torch.Tensor]]:
    """The outputs and injected gradients that make rows ``k·rows_per .. (k+1)·rows_per − 1`` carry target k (a
    feature's pre-activation h = x W_enc[:, f] + b_enc[f], or a logit minus the mean logit at the last position)."""
    outputs: list[torch.Tensor] = []
    injected: list[torch.Tensor] = []
    grads: dict[int, torch.Tensor] = {}
    logit_grad = torch.zeros_like(logits)
    for k, target in enumerate(targets):
        rows = slice(k * rows_per, (k + 1) * rows_per)
        if target < graph.n_features:
            layer, position, feature = (int(v) for v in graph.active_features[target])
            x = run_inputs[layer]
            grad = grads.setdefault(layer, torch.zeros_like(x))
            grad[rows, position] = model.layers[layer].transcoder.W_enc.detach()[:, feature].to(x.dtype)
        elif target >= graph.logit_start:
            logit_grad[rows] = -1.0 / logits.shape[-1]
            logit_grad[rows, int(graph.logit_tokens[target - graph.logit_start])] += 1.0
    for layer, grad in grads.items():
        outputs.append(run_inputs[layer])
        injected.append(grad)
    if bool(logit_grad.any()):
        outputs.append(logits)
        injected.append(logit_grad)
    return outputs, injected


def _target_rows(heads: list[int], layers: Sequence[int]) -> int:
    """One target's rows over the attention ``layers`` (site indices): the edge's, and per layer the bypass's and
    one per head."""
    return 1 + sum(heads[index] + 1 for index in layers)


def _masks(sites: list[AttentionSite], heads: list[int], n_targets: int, device: torch.device,
           layers: Sequence[int] | None = None) -> list[torch.Tensor]:
    """Per site, the 0/1 mask ``[rows, heads, 1, 1]`` of the row layout (module docstring): per target, row 0 all
    open; per site L of ``layers`` (default: every site, in order), a row with L closed and one row per head with
    only that head of L open."""
    chosen = list(range(len(heads))) if layers is None else list(layers)
    per_target = _target_rows(heads, chosen)
    masks = [torch.ones(n_targets * per_target, h, 1, 1, device=device) for h in heads]
    for k in range(n_targets):
        row = k * per_target + 1
        for index in chosen:
            h = heads[index]
            masks[index][row:row + h + 1] = 0
            for head in range(h):
                masks[index][row + 1 + head, head] = 1
            row += h + 1
    return masks


def _layer_groups(heads: list[int], batch_size: int) -> list[list[int]]:
    """The attention layers in consecutive groups whose rows (1 + Σ (heads + 1)) fit ``batch_size``.

    Raises:
        CircuitError: ``batch_size`` below one layer's rows.
    """
    need = max(_target_rows(heads, [index]) for index in range(len(heads)))
    if batch_size < need:
        raise CircuitError(f"batch_size={batch_size} cannot hold one attention layer's rows ({need}: the edge, the "
                           f"bypass and one per head); give at least {need}")
    groups: list[list[int]] = [[]]
    for index in range(len(heads)):
        if groups[-1] and _target_rows(heads, [*groups[-1], index]) > batch_size:
            groups.append([])
        groups[-1].append(index)
    return groups


def _stop_op(mask: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """out · m + (out · (1 − m)).detach(): the value unchanged, gradient only where m = 1 (``mask`` ``[rows, heads,
    1, 1]``)."""
    def op(out: torch.Tensor) -> torch.Tensor:
        m = mask.to(out.dtype)
        return out * m + (out * (1 - m)).detach()
    return op


def head_loadings(model: ReplacementModel, graph: AttributionGraph, targets: Sequence[int],
                  sources: Sequence[Sequence[int]] | None = None, batch_size: int = 64,
                  float64: bool = True) -> HeadLoadings:
    """The head loadings of the edges into ``targets`` (module docstring).

    Args:
        model: the replacement model the graph was built on.
        graph: its attribution graph.
        targets: feature or logit node indices.
        sources: per target, the source nodes whose edges to split (default: every source with a non-zero edge).
        batch_size: rows per forward pass (memory grows with it): whole targets' rows (1 + Σ_L (heads_L + 1) each)
            when one fits, else one target's in passes over groups of attention layers (1 + Σ (heads + 1) rows of
            the group's layers each).
        float64: compute the rows on a float64 copy of ``model`` (module docstring; it holds 8 bytes per parameter
            while it runs); ``False``: in the model's own dtype, without a copy (the loadings then miss their edge by
            the rounding of the rows: up to 6.2e-4 relative on the tiny GPT-2 in float32).

    Returns:
        :class:`HeadLoadings` (on the CPU; float64 with ``float64``).

    Raises:
        CircuitError: a target that is not a feature or logit node; a ``batch_size`` below one attention layer's
            rows (1 + heads + 1).
        AttentionFitError: the graph's attention is not found (:func:`find_attention_sites`; a score that is not
            bilinear, such as Gemma 2's soft-capped one, is no obstacle here).
    """
    for target in targets:
        if not (0 <= target < graph.n_features or graph.logit_start <= target < graph.n_nodes):
            raise CircuitError(f"node {target} is not a feature or logit node (an error or token node has no "
                               f"incoming edges); give targets in 0 .. {graph.n_features - 1} or "
                               f"{graph.logit_start} .. {graph.n_nodes - 1}")
    sites = find_attention_sites(model.pg, bilinear=False)
    heads = [int(model.pg.node(site.output).tensor_shape[1]) for site in sites]
    exact = float64_replacement(model) if float64 else model
    casts = cast_nodes(exact) if exact.embeddings.dtype == torch.float64 else []
    per_target = _target_rows(heads, range(len(heads)))
    per_pass = max(1, batch_size // per_target)
    groups = _layer_groups(heads, batch_size) if per_target > batch_size else None
    indices: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    edges: list[torch.Tensor] = []
    for start in range(0, len(targets), per_pass):
        chunk = list(targets[start:start + per_pass])
        if groups is None:
            rows = _rows(exact, graph, sites, heads, chunk, casts)  # [len(chunk) · per_target, n_sources]
        else:  # one target, its layers in groups of passes; the edge's row from the first
            parts = [_rows(exact, graph, sites, heads, chunk, casts, group) for group in groups]
            rows = torch.cat([parts[0][:1], *(part[1:] for part in parts)])
        for k, target in enumerate(chunk):
            block = rows[k * per_target:(k + 1) * per_target]
            chosen = (torch.as_tensor(list(sources[start + k]), dtype=torch.long) if sources is not None
                      else block[0].nonzero().squeeze(-1).cpu())
            full = block[0, chosen]
            edges.append(torch.stack([torch.full_like(full, target), chosen.to(full.dtype), full], 1))
            row = 1
            for layer, h in enumerate(heads):
                bypass = block[row, chosen]
                loads = block[row + 1:row + 1 + h, chosen] - bypass  # [h, sources]
                table = torch.cat([loads, bypass[None]])  # heads then bypass
                head_ids = torch.arange(-1, h).roll(-1)  # 0..h-1, -1
                keep = table != 0
                where = keep.nonzero()
                indices.append(torch.stack([torch.full((len(where),), target), chosen[where[:, 1]],
                                            torch.full((len(where),), layer), head_ids[where[:, 0]]], 1))
                values.append(table[keep])
                row += h + 1
    return HeadLoadings(torch.cat(indices) if indices else torch.zeros(0, 4, dtype=torch.long),
                        torch.cat(values) if values else torch.zeros(0, dtype=torch.float64),
                        torch.cat(edges) if edges else torch.zeros(0, 3, dtype=torch.float64), heads)


def _rows(model: ReplacementModel, graph: AttributionGraph, sites: list[AttentionSite], heads: list[int],
          targets: list[int], casts: list[tuple[str, str]], layers: Sequence[int] | None = None) -> torch.Tensor:
    """One forward pass (the row layout of :func:`_masks`, over ``layers``) and one backward pass, each of ``casts``
    passing its float64 input on (:func:`~gradpatch.circuits.float64.float64_casts`): g · contribution for every
    source ``[rows, graph.logit_start]`` (on the CPU)."""
    device = model.embeddings.device
    masks = _masks(sites, heads, len(targets), device, layers)
    batch = masks[0].shape[0]
    embed = HoldPatch(leaf=True)
    held = {layer: HoldPatch() for layer in model.layers}
    patches: dict[str, list[Patch]] = float64_casts(casts)
    patches.setdefault(model.embed, []).append(embed)
    for layer, spliced in model.layers.items():
        patches.setdefault(spliced.output_node, []).append(held[layer])
    for site, mask in zip(sites, masks):
        patches.setdefault(site.output, []).append(CustomPatch(custom_op=_stop_op(mask), requires_clone=False))
    cut = logits_input(model.pg)
    if cut is not None:
        patches.setdefault(cut, []).append(last_position_cut())
    with torch.enable_grad(), frozen_parameters(model.pg, *(s.transcoder for s in model.layers.values())):
        run = model.run(batch, patches=patches)
        outputs, injected = _target_gradient(model, graph, run.inputs, run.logits[:, -1], targets,
                                             batch // len(targets))
        layers = sorted(model.layers)
        grads = torch.autograd.grad(outputs, [held[l].held for l in layers] + [embed.held], injected,
                                    allow_unused=True)
    gradients = {layer: g for layer, g in zip(layers, grads[:-1]) if g is not None}
    embed_gradient = grads[-1] if grads[-1] is not None else torch.zeros_like(embed.held)
    return contract_sources(model, graph, gradients, embed_gradient).cpu()


def save_head_loadings(loadings: HeadLoadings, directory: str | Path) -> list[Path]:
    """Write ``head_loadings.safetensors`` (indices, values, edges) and ``head_loadings.json`` (the edges with their
    per-layer splits, for a viewer's selected edge) into ``directory``, each atomically.

    Returns:
        The paths written.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {"indices": loadings.indices.contiguous(), "values": loadings.values.contiguous(),
               "edges": loadings.edges.contiguous(), "heads": torch.tensor(loadings.heads)}
    records = []
    for target, source, weight in loadings.edges.tolist():
        split = loadings.edge(int(target), int(source))
        records.append({"target": int(target), "source": int(source), "weight": weight,
                        "layers": {str(layer): {"heads": per_head.tolist(), "bypass": bypass}
                                   for layer, (per_head, bypass) in sorted(split.items())}})
    text = json.dumps({"definition": "per attention layer L: weight = bypass + sum(heads) (docs/attention.md)",
                       "edges": records})
    return [atomic_write_bytes(directory / "head_loadings.safetensors", save_safetensors(tensors)),
            atomic_write_text(directory / "head_loadings.json", text)]
