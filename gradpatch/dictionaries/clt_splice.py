"""Splicing a cross-layer transcoder into a :class:`~gradpatch.PatchableGraph` as patches.

CLT layer l reads x_l at ``input_nodes[l]`` (a :class:`~gradpatch.dictionaries.TranscoderInput`, as a transcoder's)
and a :class:`CLTOutputPatch` at ``output_nodes[l]`` encodes a_l = encode(l, x_l), then replaces that node's value
y_l by::

    ŷ_l(a′) + [error_term] · (y_l − ŷ_l(a)) + Σ_{(s, i), s ≤ l} α_{s,i} W_dec[s][i, l − s]      (α: steer)

where ŷ_l(a) = Σ_{s ≤ l} a_s W_dec[s][:, l − s] + b_dec[l] (+ x_l W_skip[l]ᵀ) and a′ are the latents of every layer
s ≤ l after their edits (``ablate`` → 0, then ``scale``, then ``clamp``, per (layer, latent)). The error term, one
per layer, is computed as :func:`~gradpatch.dictionaries.splice` computes a transcoder's: y_l + (ŷ_l(a′) − ŷ_l(a))
with y_l and ŷ_l(a) detached, so with no edit every output node keeps the model's value bit for bit while the latents
of every layer are read out, and an edit of latent (s, i) changes output node l ≥ s by (a′_{s,i} − a_{s,i})
W_dec[s][i, l − s] (to float rounding). Gradients reach the inputs and the CLT through ŷ(a′) only.

Layer 0's output patch starts each forward pass (it forgets the previous pass's latents), so ``pg.generate`` with a
KV cache splices every step. The output node of layer l must run after the output nodes of layers < l and after its
own input node, as an MLP's output runs after its input and after the earlier layers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..patches import Patch, Slice
from .clt import CrossLayerTranscoder
from .errors import DictionaryConfigError, DictionaryShapeError
from .splice import TranscoderInput, check_node_width, edit_latents, first_position_of, take_held_input

__all__ = ["CLTLatents", "CLTOutputPatch", "CLTSplice", "LatentKey", "clt_nodes", "splice_clt"]

#: A CLT latent: (CLT layer, latent index), the layer counting from 0 (``config.layers`` maps it to a model layer).
LatentKey = tuple[int, int]


@dataclass(eq=False)
class CLTLatents:
    """What the output patches of one spliced CLT share within a forward pass.

    Attributes:
        n_layers: ``L``.
        clean: a_l (with autograd history) of each layer spliced so far in this pass, ``None`` for the others.
        edited: a′_l, the same object as ``clean[l]`` where layer l has no edit.
    """

    n_layers: int
    clean: list[torch.Tensor | None] = field(init=False)
    edited: list[torch.Tensor | None] = field(init=False)

    def __post_init__(self) -> None:
        self.clean, self.edited = [None] * self.n_layers, [None] * self.n_layers

    def forget(self, first_layer: int) -> None:
        """Drop the latents of layers ``first_layer`` and above (layer 0: a new forward pass)."""
        for layer in range(first_layer, self.n_layers):
            self.clean[layer] = self.edited[layer] = None


@dataclass(kw_only=True, eq=False)
class CLTOutputPatch(Patch):
    """CLT layer ``layer`` spliced at the node it writes (module docstring for the value computed).

    Attributes:
        clt: the cross-layer transcoder (on the activations' device).
        layer: the CLT layer l.
        shared: the :class:`CLTLatents` of this splice, common to its ``L`` output patches.
        source: the :class:`~gradpatch.dictionaries.TranscoderInput` at layer l's input node.
        error_term: add layer l's detached error y_l − ŷ_l(a).
        ablate, scale, clamp: edits of this layer's latents (indices ``0..m−1``).
        steer: (layer s ≤ l, latent i) -> α, adding α W_dec[s][i, l − s] to this node.
        record: keep every forward pass's latents in :attr:`recorded`.
        latents: a_l ``[..., m]`` of the last forward pass (detached, before edits) at the positions spliced,
            ``None`` before any pass and after a pass whose ``slice`` selected no token.
        first_position: as :attr:`~gradpatch.dictionaries.DictionaryPatch.first_position`.
        recorded: the latents of every forward pass when ``record`` is set.

    Raises:
        DictionaryShapeError: in the forward pass, an output node of an earlier CLT layer or this layer's input node
            that did not run before this node, or leading (batch, position) sizes that differ between the nodes.
    """

    clt: CrossLayerTranscoder
    layer: int
    shared: CLTLatents
    source: TranscoderInput
    error_term: bool = True
    ablate: Sequence[int] = ()
    scale: Mapping[int, float] = field(default_factory=dict)
    clamp: Mapping[int, float] = field(default_factory=dict)
    steer: Mapping[LatentKey, float] = field(default_factory=dict)
    record: bool = False
    latents: torch.Tensor | None = field(default=None, repr=False)
    first_position: int | None = field(default=None, repr=False)
    recorded: list[torch.Tensor] = field(default_factory=list, repr=False)
    requires_clone: bool = field(default=False, init=False, repr=False)

    def check_width(self, width: int, path: str) -> None:
        """Raise :class:`DictionaryShapeError` unless the node at ``path`` has last dimension ``d_out``."""
        check_node_width(width, self.clt.d_out, path, "output")

    def __call__(self, original: torch.Tensor) -> torch.Tensor:
        self.latents, self.first_position = None, first_position_of(self.slice, original)
        self.shared.forget(self.layer)
        return super().__call__(original)

    def _earlier(self, current: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The clean and edited latents of layers 0..l (this layer's being ``current``'s)."""
        shared, layer = self.shared, self.layer
        missing = [s for s in range(layer) if shared.clean[s] is None]
        if missing:
            raise DictionaryShapeError(f"CLT layer {layer}'s output node ran before the output nodes of CLT layers "
                                       f"{missing} in this forward pass; give the CLT nodes in the model's order")
        clean = [shared.clean[s] for s in range(layer + 1)]
        if any(a.shape != current.shape for a in clean):  # type: ignore[union-attr]
            raise DictionaryShapeError(f"CLT layer {layer}'s latents {tuple(current.shape)} and an earlier layer's "
                                       f"{[tuple(a.shape) for a in clean]} differ in their leading sizes; give "
                                       f"every CLT node the same slice")
        return clean, [shared.edited[s] for s in range(layer + 1)]  # type: ignore[misc]

    def op(self, original: torch.Tensor) -> torch.Tensor:
        x = take_held_input(self.source, original, f"CLT layer {self.layer}")
        clt, layer = self.clt, self.layer
        a = clt.encode(layer, x)
        self.latents = a.detach()
        if self.record:
            self.recorded.append(self.latents)
        self.shared.clean[layer] = a
        self.shared.edited[layer] = edit_latents(a, self.ablate, self.scale, self.clamp)
        clean, edited = self._earlier(a)
        value = clt.output(layer, x, edited)
        if self.error_term:  # y + (ŷ(a′) − ŷ(a)): exactly y when no latent of layers <= l is edited
            unedited = all(e is c for e, c in zip(edited, clean))
            reference = value if unedited else clt.output(layer, x, clean)
            value = original.detach().to(value.dtype) + (value - reference.detach())
        for (source, index), alpha in self.steer.items():
            value = value + alpha * clt.W_dec[source][index, layer - source]
        return value.to(original.dtype)


@dataclass
class CLTSplice:
    """The patches of one spliced CLT: ``with pg.patch(clt_splice): ...`` applies them (or merge :meth:`patch_map`).

    Attributes:
        patches: the :class:`CLTOutputPatch` of each CLT layer, in layer order.
        readers: the :class:`~gradpatch.dictionaries.TranscoderInput` of each CLT layer.
        input_nodes, output_nodes: the NodePaths read and written, one per CLT layer.
    """

    patches: list[CLTOutputPatch]
    readers: list[TranscoderInput]
    input_nodes: list[str]
    output_nodes: list[str]

    @property
    def latents(self) -> list[torch.Tensor | None]:
        """a_l of the last forward pass for each CLT layer l (detached, before edits; ``[batch, seq, m]`` without a
        slice, ``[batch, seq − n, m]`` for :func:`~gradpatch.dictionaries.trained_positions`-like slices)."""
        return [patch.latents for patch in self.patches]

    @property
    def first_position(self) -> int | None:
        """The position of ``latents[l][:, 0]`` in the last forward pass (the same for every layer)."""
        return self.patches[0].first_position

    def patch_map(self) -> dict[str, list[Patch]]:
        """NodePath -> patches, in CLT layer order: layer l's reader, then its output patch."""
        patches: dict[str, list[Patch]] = {}
        for reader, patch, read, write in zip(self.readers, self.patches, self.input_nodes, self.output_nodes):
            patches.setdefault(read, []).append(reader)
            patches.setdefault(write, []).append(patch)
        return patches


def clt_nodes(clt: CrossLayerTranscoder, input_nodes: Sequence[str] | None = None,
              output_nodes: Sequence[str] | None = None, *, pg: Any = None) -> tuple[list[str], list[str]]:
    """The NodePaths ``clt`` reads and writes, one per CLT layer (default: its config's).

    Args:
        clt: the cross-layer transcoder.
        input_nodes, output_nodes: ``L`` NodePaths each, overriding the config's.
        pg: the :class:`~gradpatch.PatchableGraph` to check them against (not checked when ``None``).

    Raises:
        DictionaryConfigError: nodes neither given nor recorded, or not ``L`` of them.
        NodePathError: a NodePath the graph lacks (e.g. a CLT with more layers than the model).
    """
    config, lists = clt.config, []
    for name, given in (("input_nodes", input_nodes), ("output_nodes", output_nodes)):
        nodes = list(given) if given is not None else getattr(config, name)
        if nodes is None or len(nodes) != config.n_layers:
            raise DictionaryConfigError(
                f"the CLT has {config.n_layers} layers, so it needs {config.n_layers} {name}, got "
                f"{None if nodes is None else len(nodes)}: pass {name}=[...] or build it with CLTConfig({name}=...), "
                f"e.g. [detect_layout(pg).path('mlp_input', layer) for layer in config.layers]")
        lists.append([str(node) for node in nodes])
    if pg is not None:
        for path in dict.fromkeys(lists[0] + lists[1]):
            pg.node(path)
    return lists[0], lists[1]


def _by_layer(clt: CrossLayerTranscoder, name: str, keys: Sequence[LatentKey] | Mapping[LatentKey, float]
              ) -> list[dict[int, float]]:
    """Edits ``(layer, latent) [-> value]`` grouped per CLT layer (latent -> value; 0.0 for ``ablate``)."""
    n, m = clt.n_layers, clt.d_sae
    grouped: list[dict[int, float]] = [{} for _ in range(n)]
    for key in keys:
        if not (isinstance(key, tuple) and len(key) == 2 and all(isinstance(i, int) for i in key)
                and 0 <= key[0] < n and 0 <= key[1] < m):
            raise DictionaryConfigError(f"{name} names {key!r}; CLT latents are (layer, latent) pairs with layer in "
                                        f"0..{n - 1} and latent in 0..{m - 1}")
        grouped[key[0]][key[1]] = float(keys[key]) if isinstance(keys, Mapping) else 0.0
    return grouped


def splice_clt(pg: Any, clt: CrossLayerTranscoder, input_nodes: Sequence[str] | None = None,
               output_nodes: Sequence[str] | None = None, *, error_term: bool = True,
               ablate: Sequence[LatentKey] = (), scale: Mapping[LatentKey, float] | None = None,
               clamp: Mapping[LatentKey, float] | None = None, steer: Mapping[LatentKey, float] | None = None,
               record: bool = False, slice: Slice = None) -> CLTSplice:
    """Splice a cross-layer transcoder into ``pg``: the patches for ``pg.patch`` (module docstring).

    Example::

        s = splice_clt(pg, clt, ablate=[(0, 3)])            # CLT layer 0's latent 3 off, in every later layer too
        with pg.patch(s):
            logits = pg(ids).logits
        s.latents                                           # L tensors [batch, seq, m]

    Args:
        pg: the :class:`~gradpatch.PatchableGraph`.
        clt: the cross-layer transcoder (on the activations' device).
        input_nodes, output_nodes: ``L`` NodePaths each (default: the config's).
        error_term: keep each output node's error term (exact when nothing is edited).
        ablate: (layer, latent) pairs set to 0.
        scale, clamp: (layer, latent) -> factor / value.
        steer: (layer, latent) -> α, adding α W_dec[layer][latent, l − layer] at every output layer l ≥ layer.
        record: keep every forward pass's latents (``s.patches[l].recorded``).
        slice: positions it applies to (every node takes the same), e.g. ``Tokens(slice(n, None))`` for a CLT
            trained with ``exclude_first_positions`` n (:func:`~gradpatch.dictionaries.trained_positions` of the CLT).

    Returns:
        A :class:`CLTSplice`. Widths are checked when ``pg.patch`` is entered, before any forward pass.

    Raises:
        DictionaryConfigError: nodes neither given nor recorded, or not ``L`` of them; an edit naming a layer or
            latent out of range.
        NodePathError: a NodePath the graph lacks.
    """
    inputs, outputs = clt_nodes(clt, input_nodes, output_nodes, pg=pg)
    ablated, scaled = _by_layer(clt, "ablate", tuple(ablate)), _by_layer(clt, "scale", dict(scale or {}))
    clamped, steered = _by_layer(clt, "clamp", dict(clamp or {})), _by_layer(clt, "steer", dict(steer or {}))
    shared = CLTLatents(clt.n_layers)
    readers, patches = [], []
    for layer in range(clt.n_layers):
        reader = TranscoderInput(width=clt.d_in, slice=slice)
        steer_here = {(source, index): alpha for source in range(layer + 1)
                      for index, alpha in steered[source].items()}
        patches.append(CLTOutputPatch(clt=clt, layer=layer, shared=shared, source=reader, error_term=error_term,
                                      ablate=tuple(ablated[layer]), scale=scaled[layer], clamp=clamped[layer],
                                      steer=steer_here, record=record, slice=slice))
        readers.append(reader)
    return CLTSplice(patches, readers, inputs, outputs)

