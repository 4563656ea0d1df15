"""Splicing a dictionary into a :class:`~gradpatch.PatchableGraph` as patches.

An SAE at node N replaces N's value x ``[..., d]`` by its reconstruction; a transcoder reads node A's value x
``[..., d_in]`` and replaces node B's value y ``[..., d_out]`` by its prediction. With latents z = encode(x) and
edited latents z' (:class:`DictionaryPatch`'s ``ablate``, ``scale`` and ``clamp``, in that order), the value seen
downstream is::

    output(x, z') + [error_term] · (y − output(x, z)) + Σ_i α_i W_dec[i]      (y = x for an SAE)

where output(x, z) = z W_dec + b_dec (+ x W_skipᵀ) and α are the ``steer`` coefficients. The error term is detached,
as SAELens's is: gradients reach x and the dictionary through the reconstruction only. It is computed as
y + (output(x, z') − output(x, z)) with y and the second output detached, the same value and gradient as
output(x, z') + (y − output(x, z)) but without its float rounding: with no edit the downstream value is y bit for
bit, so the spliced model computes exactly what the model does while the latents read out
(:attr:`DictionaryPatch.latents`), and editing a latent changes the value by (z' − z) W_dec. Without the error term
the model runs on the dictionary's output (what CE loss recovered scores).

The patches apply in every forward pass while ``pg.patch`` is active: ``pg(...)``, ``pg.generate`` (each KV-cache
step's new tokens), and training (the dictionary's parameters get gradients through the patched graph).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ..patches import HoldPatch, Patch, Slice
from ..positions import Tokens
from .errors import DictionaryConfigError, DictionaryShapeError
from .modules import SparseDictionary

if TYPE_CHECKING:
    from .clt import CrossLayerTranscoder

__all__ = ["DictionaryPatch", "Splice", "TranscoderInput", "check_node_width", "dictionary_nodes", "edit_latents",
           "first_position_of", "splice", "take_held_input", "trained_positions"]


@dataclass(kw_only=True, eq=False)
class TranscoderInput(HoldPatch):
    """Holds the value at a transcoder's input node (unchanged, with its autograd history) for the
    :class:`DictionaryPatch` at its output node, which takes it (resets :attr:`held` to ``None``) in the same forward
    pass.

    Attributes:
        width: the transcoder's ``d_in`` (checked against the node when ``pg.patch`` is entered).
    """

    width: int

    def check_width(self, width: int, path: str) -> None:
        """Raise :class:`DictionaryShapeError` unless the node at ``path`` has last dimension :attr:`width`."""
        check_node_width(width, self.width, path, "input")


@dataclass(kw_only=True, eq=False)
class DictionaryPatch(Patch):
    """A dictionary spliced at the node it writes (see the module docstring for the value computed).

    Attributes:
        dictionary: the SAE or transcoder (on the activations' device).
        error_term: add the detached error y − output(x, z), so that the unedited splice is exact.
        ablate: latents set to 0.
        scale: latent -> factor it is multiplied by.
        clamp: latent -> value it is set to.
        steer: latent -> α, adding α · W_dec[latent] to the value.
        record: keep every forward pass's latents in :attr:`recorded` (e.g. one per ``generate`` step).
        source: a transcoder's :class:`TranscoderInput` (``None`` for an SAE, which reads the value it replaces).
        latents: z ``[..., m]`` of the last forward pass (detached; before edits) at the positions spliced: with a
            ``slice``, those of ``value[slice]`` (e.g. ``[batch, seq − n, m]`` for :func:`trained_positions`);
            ``None`` before any pass and after a pass whose ``slice`` selected no token.
        first_position: the position, along the token dimension of the last forward pass's value, of
            ``latents[:, 0]``: 0 without a slice, n − offset for :func:`trained_positions` (``Tokens(slice(n, None))``:
            n in a whole sequence, 0 in a ``generate`` step past n), ``None`` for a slice that is not a contiguous
            range of :class:`~gradpatch.positions.Tokens` (the latents then have the slice's own shape).
        recorded: the latents of every forward pass when ``record`` is set.

    Raises:
        DictionaryConfigError: at construction, a latent index outside ``0..d_sae-1``.
        DictionaryShapeError: in the forward pass, a transcoder whose input node did not run before its output node
            in that pass, or whose two nodes differ in their leading (batch, position) sizes.
    """

    dictionary: SparseDictionary
    error_term: bool = True
    ablate: Sequence[int] = ()
    scale: Mapping[int, float] = field(default_factory=dict)
    clamp: Mapping[int, float] = field(default_factory=dict)
    steer: Mapping[int, float] = field(default_factory=dict)
    record: bool = False
    source: TranscoderInput | None = None
    latents: torch.Tensor | None = field(default=None, repr=False)
    first_position: int | None = field(default=None, repr=False)
    recorded: list[torch.Tensor] = field(default_factory=list, repr=False)
    requires_clone: bool = field(default=False, init=False, repr=False)

    def __post_init__(self) -> None:
        m = self.dictionary.d_sae
        for name in ("ablate", "scale", "clamp", "steer"):
            bad = [i for i in getattr(self, name) if not isinstance(i, int) or not 0 <= i < m]
            if bad:
                raise DictionaryConfigError(f"{name} names latents {bad}, outside 0..{m - 1} (d_sae={m})")

    def check_width(self, width: int, path: str) -> None:
        """Raise :class:`DictionaryShapeError` unless the node at ``path`` has last dimension ``d_out``."""
        check_node_width(width, self.dictionary.d_out, path, "output")

    def _input(self, original: torch.Tensor) -> torch.Tensor:
        return original if self.source is None else take_held_input(self.source, original, "transcoder")

    def __call__(self, original: torch.Tensor) -> torch.Tensor:
        self.latents, self.first_position = None, first_position_of(self.slice, original)
        return super().__call__(original)

    def op(self, original: torch.Tensor) -> torch.Tensor:
        x = self._input(original)
        dictionary = self.dictionary
        z = dictionary.encode(x)
        self.latents = z.detach()
        if self.record:
            self.recorded.append(self.latents)
        edited = edit_latents(z, self.ablate, self.scale, self.clamp)
        value = dictionary.output(x, edited)
        if self.error_term:  # y + (x̂' − x̂): the same sum as x̂' + (y − x̂), but exactly y when nothing is edited
            clean = value if edited is z else dictionary.output(x, z)
            value = original.detach().to(value.dtype) + (value - clean.detach())
        if self.steer:
            alphas = torch.tensor(list(self.steer.values()), dtype=value.dtype, device=value.device)
            value = value + alphas @ dictionary.W_dec[list(self.steer)]
        return value.to(original.dtype)


def take_held_input(source: TranscoderInput, original: torch.Tensor, what: str) -> torch.Tensor:
    """The input node's value that ``source`` holds for this forward pass, taken (``source.held`` reset to ``None``).

    Args:
        source: the reader at the input node.
        original: the value (or its slice) at the output node, whose leading sizes the input must share.
        what: the dictionary named in errors, e.g. ``"transcoder"``.

    Raises:
        DictionaryShapeError: the input node did not run before the output node in this pass, or the two differ in
            their leading (batch, position) sizes.
    """
    x, source.held = source.held, None
    if x is None:
        raise DictionaryShapeError(f"the {what}'s input node did not run before its output node in this forward "
                                   f"pass; splice it reading a node that the model computes first")
    if x.shape[:-1] != original.shape[:-1]:
        raise DictionaryShapeError(f"the {what}'s input {tuple(x.shape)} and output {tuple(original.shape)} differ in "
                                   f"their leading sizes; give both nodes the same slice")
    return x


def edit_latents(z: torch.Tensor, ablate: Sequence[int], scale: Mapping[int, float],
                 clamp: Mapping[int, float]) -> torch.Tensor:
    """Latents ``z`` ``[..., m]`` with ``ablate`` set to 0, then ``scale`` multiplied, then ``clamp`` set (a copy;
    ``z`` itself, the same object, when there is no edit)."""
    if not (ablate or scale or clamp):
        return z
    z = z.clone()
    if ablate:
        z[..., list(ablate)] = 0
    if scale:
        index = list(scale)
        z[..., index] = z[..., index] * torch.tensor(list(scale.values()), dtype=z.dtype, device=z.device)
    if clamp:
        z[..., list(clamp)] = torch.tensor(list(clamp.values()), dtype=z.dtype, device=z.device)
    return z


def first_position_of(chosen: Slice, value: torch.Tensor) -> int | None:
    """:attr:`DictionaryPatch.first_position` for a pass whose value at the node is ``value`` and slice ``chosen``."""
    if chosen is None:
        return 0
    index = chosen.index(value) if isinstance(chosen, Tokens) else None
    if index is None or not isinstance(index[chosen.dim], slice):
        return None
    return index[chosen.dim].start or 0


def check_node_width(width: int, expected: int, path: str, side: str) -> None:
    """Raise :class:`DictionaryShapeError` (naming both widths) unless the node at ``path`` has width ``expected``
    (``side``: ``"input"`` or ``"output"``, the dictionary's side that meets it)."""
    if width != expected:
        raise DictionaryShapeError(f"the dictionary's {side} width is {expected}, but '{path}' has last dimension "
                                   f"{width}: splice it at a node of width {expected}, or load the dictionary "
                                   f"trained for this node")


@dataclass
class Splice:
    """The patches of one spliced dictionary: ``with pg.patch(splice): ...`` applies them (or merge
    :meth:`patch_map` with other patches).

    Attributes:
        patch: the :class:`DictionaryPatch` at :attr:`output_node` (its ``latents``, ``recorded``, edits).
        output_node: the NodePath written.
        input_node: the NodePath read (that of :attr:`patch` for an SAE).
        reader: a transcoder's :class:`TranscoderInput` at :attr:`input_node`, ``None`` for an SAE.
    """

    patch: DictionaryPatch
    output_node: str
    input_node: str
    reader: TranscoderInput | None = None

    @property
    def latents(self) -> torch.Tensor | None:
        """z of the last forward pass (detached, before edits), at the positions spliced only:
        ``[batch, seq, m]`` without a slice, ``[batch, seq − n, m]`` for :func:`trained_positions` (a dictionary
        trained with ``exclude_first_positions`` n: positions < n are not spliced, and have no latents). Position p
        of the pass is ``latents[:, p − first_position]``; ``None`` before any pass and after a pass that spliced
        no token."""
        return self.patch.latents

    @property
    def first_position(self) -> int | None:
        """The position of ``latents[:, 0]`` in the last forward pass (:attr:`DictionaryPatch.first_position`):
        n for :func:`trained_positions` on a whole sequence, 0 without a slice."""
        return self.patch.first_position

    def patch_map(self) -> dict[str, list[Patch]]:
        """NodePath -> patches, the reader first when a transcoder reads and writes one node."""
        patches: dict[str, list[Patch]] = {}
        if self.reader is not None:
            patches[self.input_node] = [self.reader]
        patches.setdefault(self.output_node, []).append(self.patch)
        return patches


def trained_positions(dictionary: SparseDictionary | CrossLayerTranscoder) -> Tokens | None:
    """The ``slice`` that splices ``dictionary`` (or a cross-layer transcoder) only where it was trained:
    ``Tokens(slice(n, None))`` (absolute positions n.., resolved in each forward pass, so also in ``pg.generate`` with
    a KV cache) for a config's ``exclude_first_positions`` n > 0, ``None`` (every position) for 0. The training
    modules and :func:`~gradpatch.dictionaries.evaluate_dictionary` splice with it; give it to :func:`splice` (or
    :func:`~gradpatch.dictionaries.splice_clt`) as ``slice=``.

    Example::

        s = splice(pg, sae, slice=trained_positions(sae))
        with pg.patch(s):
            logits = pg(ids).logits     # positions < n keep the model's values; s.latents [batch, seq − n, m]
        s.latents[:, p - s.first_position]                                    # position p's latents, p >= n
    """
    n = dictionary.config.exclude_first_positions
    return Tokens(slice(n, None)) if n else None


def dictionary_nodes(dictionary: SparseDictionary, node: str | None = None, output_node: str | None = None, *,
                     pg: Any = None) -> tuple[str, str]:
    """The NodePaths ``dictionary`` reads and writes, ``(read, written)``: the same path twice for an SAE. What
    :func:`splice`, the attribution graphs and the training recipes resolve a dictionary's nodes with.

    Args:
        dictionary: an SAE or (skip) transcoder.
        node: the NodePath read (default: the config's ``input_node``).
        output_node: a transcoder's NodePath written (default: the config's ``output_node``; ignored for an SAE).
        pg: the :class:`~gradpatch.PatchableGraph` to check both NodePaths against (not checked when ``None``).

    Returns:
        ``(read, written)``.

    Raises:
        DictionaryConfigError: a NodePath neither given nor recorded in the config (the message names the fix).
        NodePathError: a NodePath ``pg`` lacks (the message lists the closest valid ones).
    """
    config = dictionary.config
    read = node or config.input_node
    transcoder = config.kind != "sae"
    write = (output_node or config.output_node) if transcoder else read
    if read is None or write is None:
        raise DictionaryConfigError(
            f"the {config.kind}'s config names no node to {'read' if read is None else 'write'}: name the "
            f"node{'s' if transcoder else ''} (node=...{', output_node=...' if transcoder else ''}), or build it with "
            f"{'input_node=... and output_node=...' if transcoder else 'node=...'}")
    if pg is not None:
        for path in dict.fromkeys((read, write)):
            pg.node(path)
    return str(read), str(write)


def splice(pg: Any, dictionary: SparseDictionary, node: str | None = None, *, output_node: str | None = None,
           error_term: bool = True, ablate: Sequence[int] = (), scale: Mapping[int, float] | None = None,
           clamp: Mapping[int, float] | None = None, steer: Mapping[int, float] | None = None, record: bool = False,
           slice: Slice = None) -> Splice:
    """Splice ``dictionary`` into ``pg``: the patches for ``pg.patch``.

    Example::

        s = splice(pg, sae, "model.layers_1.output", ablate=[3])
        with pg.patch(s):
            logits = pg(ids).logits          # s.latents: [batch, seq, m]

    Args:
        pg: the :class:`~gradpatch.PatchableGraph`.
        dictionary: an SAE or (skip) transcoder.
        node: the NodePath read (default: the dictionary's ``input_node``); an SAE also writes it.
        output_node: a transcoder's NodePath written (default: its ``output_node``).
        error_term, ablate, scale, clamp, steer, record: as :class:`DictionaryPatch`.
        slice: positions it applies to (any patch's ``slice``; a transcoder's input and output take the same).

    Returns:
        A :class:`Splice`. Widths are checked when ``pg.patch`` is entered, before any forward pass.

    Raises:
        DictionaryConfigError: no node given nor recorded in the dictionary's config (:func:`dictionary_nodes`); a
            latent index out of range.
        NodePathError: a NodePath the graph lacks (the message lists the closest valid ones).
    """
    read, write = dictionary_nodes(dictionary, node, output_node, pg=pg)
    reader = TranscoderInput(width=dictionary.d_in, slice=slice) if dictionary.config.kind != "sae" else None
    patch = DictionaryPatch(dictionary=dictionary, error_term=error_term, ablate=tuple(ablate), scale=dict(scale or {}),
                            clamp=dict(clamp or {}), steer=dict(steer or {}), record=record, source=reader,
                            slice=slice)
    return Splice(patch, write, read, reader)
