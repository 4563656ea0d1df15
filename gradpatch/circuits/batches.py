"""The backward passes of :func:`~gradpatch.circuits.attribute.attribute`: which forward pass serves each target, and
which targets share a backward pass.

A target's gradients reach the layers below its own and the positions up to its own alone (the model is causal and
its attention patterns are frozen, so nothing flows from a later position to an earlier one). A backward pass costs
about (rows) × (layers below its highest target) × (positions of its forward pass); so

- targets share a backward pass with targets of nearby layers (sorted by layer, then position, ``batch`` at a time);
- a feature target at position p may be served by a forward pass of the prompt's first ``length`` > p positions
  (:meth:`~gradpatch.circuits.replacement.ReplacementModel.run`'s ``length``), whose backward passes are shorter.
  :func:`choose_lengths` adds such lengths one at a time, each where it saves most of the cost model below, while it
  saves more than its forward pass costs; the logits and the features at the last positions keep the whole prompt.

The cost model is in units of one row's backward pass through one layer at one position (measured on SmolLM2 on one
CPU thread: about 20 µs; a one-row forward pass of the replacement model costs about :data:`FORWARD_COST` +
:data:`FORWARD_COST_PER_POSITION` × positions of those units). It only chooses the batches: every row is computed
exactly whatever the choice (the gradients of a target do not depend on the forward pass serving it, up to float
rounding, nor on the other rows of its pass).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .backward import Target
from .replacement import ReplacementModel

__all__ = ["FORWARD_COST", "FORWARD_COST_PER_POSITION", "MAX_LENGTHS", "PASS_COST", "causal", "choose_lengths",
           "plan_batches"]

#: A one-row forward pass's cost whatever its length, in row × layer × position units (module docstring).
FORWARD_COST = 5_000
#: Its cost per position, in the same units.
FORWARD_COST_PER_POSITION = 150
#: A backward pass's own cost, in the same units.
PASS_COST = 500
#: Forward-pass lengths per round of targets, at most (each is run and freed in turn).
MAX_LENGTHS = 16


def causal(model: ReplacementModel) -> bool:
    """Whether a forward pass of the first positions serves the targets before them: every frozen attention pattern
    is known and lower-triangular (an SDPA call's recorded A⁰, a frozen softmax's value ``[1, heads, seq, seq]``),
    and the forward pass takes no argument beside the ids (a mask or positions of the whole prompt)."""
    if model.forward_kwargs:
        return False
    patterns = {pattern.query for pattern, _ in model.pattern_values} | {pattern.key for pattern, _ in
                                                                          model.pattern_values}
    values = [a0 for _, a0 in model.pattern_values]
    for path in model.frozen.attention:
        if path in patterns:
            continue
        value = model.frozen_values.get(path)
        if value is None or value.dim() != 4 or value.shape[-1] != value.shape[-2]:
            return False  # the query or key of an SDPA call whose pattern is not recorded
        values.append(value)
    seq = model.ids.shape[1]
    return all(value.shape[-2:] == (seq, seq) and not bool(torch.triu(value, 1).any()) for value in values)


def _costs(below: torch.Tensor, low: torch.Tensor, high: torch.Tensor, length: torch.Tensor,
           batch: int) -> torch.Tensor:
    """The cost (module docstring) of the backward passes of the features at positions ``low``..``high`` − 1 on a
    forward pass of ``length`` positions, each ``[k]``: sorted by layer, ``batch`` at a time, each pass as long as
    its highest layer. ``below`` ``[seq + 1, layers]``: the features at positions < λ, per layer."""
    counts = torch.cumsum(below[high] - below[low], 1)  # [k, layers]: features of layers ≤ ℓ
    total = counts[:, -1]
    steps = torch.arange(int(-(-int(total.max()) // batch)) if len(total) else 0, dtype=counts.dtype)
    ends = torch.minimum((steps + 1) * batch, total[:, None])  # [k, passes]
    sizes = (ends - steps * batch).clamp_min(0)
    tops = torch.searchsorted(counts, (ends - 1).clamp_min(0).contiguous(), right=True)  # each pass's highest layer
    return length * (sizes * tops).sum(1) + PASS_COST * torch.ceil(total / batch)


def choose_lengths(targets: Sequence[Target], seq: int, batch: int) -> list[int]:
    """The forward-pass lengths for ``targets`` (module docstring), ascending, the last ``seq`` (always run: it
    serves the logits); each feature target goes to the shortest length above its position.

    Args:
        targets: the targets of one round.
        seq: the prompt's length.
        batch: targets per backward pass.
    """
    features = [(t.position, t.layer) for t in targets if t.kind == "feature"]
    if not features:
        return [seq]
    found = torch.tensor(features, dtype=torch.long)
    below = torch.zeros(seq + 1, int(found[:, 1].max()) + 1, dtype=torch.float64)
    below.index_put_((found[:, 0] + 1, found[:, 1]), torch.ones(len(found), dtype=torch.float64), accumulate=True)
    below = torch.cumsum(below, 0)
    candidates = torch.arange(seq + 1)
    lengths = [seq]
    while len(lengths) < MAX_LENGTHS:
        bounds = torch.tensor(lengths)
        index = torch.searchsorted(bounds, candidates, right=True).clamp_max(len(lengths) - 1)
        high = bounds[index]  # the length now serving the features just below each candidate
        low = torch.cat([bounds.new_zeros(1), bounds])[index]
        before = _costs(below, low, high, high, batch)
        after = _costs(below, low, candidates, candidates, batch) + _costs(below, candidates, high, high, batch)
        saving = before - after - (FORWARD_COST + FORWARD_COST_PER_POSITION * candidates)
        saving[:2] = 0  # a forward pass runs at least 2 positions
        saving[bounds] = 0
        best = int(saving.argmax())
        if float(saving[best]) <= 0:
            break
        lengths = sorted([*lengths, best])
    return lengths


def plan_batches(targets: Sequence[Target], lengths: Sequence[int], batch: int) -> list[tuple[int, list[int]]]:
    """The backward passes for ``targets``: (forward-pass length, indices into ``targets`` of its rows), grouped by
    length in ascending order; a feature goes to the shortest of ``lengths`` above its position, a logit to the
    longest; within a length the targets are sorted by layer, then position, and taken ``batch`` at a time."""
    groups: dict[int, list[int]] = {}
    for index, target in enumerate(targets):
        length = lengths[-1] if target.kind == "logit" else next(n for n in lengths if n > target.position)
        groups.setdefault(length, []).append(index)
    plan = []
    for length in sorted(groups):
        members = sorted(groups[length], key=lambda i: (targets[i].kind == "logit", targets[i].layer,
                                                        targets[i].position))
        plan.extend((length, members[start:start + batch]) for start in range(0, len(members), batch))
    return plan
