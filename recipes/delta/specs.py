"""Configuration records of the delta recipes: where the deltas go and what they are trained to do.

These dataclasses are what ``recipes/configs/*.yaml`` spell out under ``model:``; LightningCLI (through
jsonargparse) builds them from the YAML mappings, and :class:`~recipes.delta.DeltaModule` also accepts plain
dicts with the same keys (that is how hyperparameters come back from a checkpoint).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Union

import torch

from ..errors import RecipeConfigError
from ..training.specs import as_spec
from .objectives import KIND_KL, KIND_STEER, KIND_TARGET, away_loss, kl_loss, l2_penalty, target_nll, towards_loss

__all__ = ["DeltaSpec", "Objective", "TargetSpec", "position_slice"]

#: A delta position: ``"all"`` (every token), ``"last"`` (the last token) or a negative int counted from the end.
Position = Union[str, int]


@dataclass
class DeltaSpec:
    """One learnable AddPatch delta.

    Attributes:
        node: NodePath of a ``[batch, seq, ...]`` activation, e.g. ``"model.layers_12.output"`` (the residual stream
            after layer 12) or ``"model.layers_12.mlp.down_proj.output"``.
        position: ``"last"`` adds the delta at the last token only (``slice=(slice(None), -1)``); ``"all"`` at every
            token (a steering vector, ``slice=None``); a negative int ``-k`` at the k-th token from the end.
            Batches are left-padded, so positions counted from the end are the same tokens in every row.
    """

    node: str
    position: Position = "last"


@dataclass
class TargetSpec:
    """A target continuation: train ``prompt`` to continue with ``target``.

    Attributes:
        prompt: e.g. ``"The Eiffel Tower is located in the city of"``.
        target: e.g. ``" Rome"`` (mind the leading space); several tokens are allowed.
    """

    prompt: str
    target: str


@dataclass
class Objective:
    """What the deltas are trained to do; every term is scored at the last position of its prompt.

    It is the objective of :class:`~recipes.delta.DeltaModule` (a plain dataclass: LightningCLI reads it as its
    fields, ``objective.targets``...): :meth:`loss_terms` takes the last position's log-probabilities of a batch of
    rows and the tensors its terms compare them with.

    ``loss = nll_weight·NLL + towards_weight·L_towards + away_weight·L_away + kl_weight·KL + l2_weight·Σ‖δ‖²``
    (terms without prompts are left out).

    Attributes:
        targets: target continuations; ``NLL = -mean log P(target token | prompt, target tokens before it)``,
            each continuation weighted equally whatever its length.
        steer_prompts: prompts on which the next-token distribution is steered.
        towards: single-token strings to make likely after ``steer_prompts``: ``L_towards = -log Σ_{t∈towards} P(t)``.
        away: single-token strings to make unlikely: ``L_away = -log(1 - Σ_{t∈away} P(t))`` (minimises their
            log-probability while staying bounded below by 0).
        kl_prompts: neutral prompts whose next-token distribution should not move:
            ``KL = KL(P_unpatched ‖ P_patched)`` at their last token.
        nll_weight, towards_weight, away_weight, kl_weight: term weights.
        l2_weight: weight of ``Σ_i ‖δ_i‖²`` over all deltas.
    """

    targets: list[TargetSpec] = field(default_factory=list)
    steer_prompts: list[str] = field(default_factory=list)
    towards: list[str] = field(default_factory=list)
    away: list[str] = field(default_factory=list)
    kl_prompts: list[str] = field(default_factory=list)
    nll_weight: float = 1.0
    towards_weight: float = 1.0
    away_weight: float = 1.0
    kl_weight: float = 1.0
    l2_weight: float = 0.0

    def __post_init__(self) -> None:
        self.targets = [as_spec(TargetSpec, target) for target in self.targets]

    def term_names(self) -> list[str]:
        """Names of the loss terms this objective computes (``"nll"``, ``"towards"``, ``"away"``, ``"kl"``, ``"l2"``).

        Raises:
            RecipeConfigError: no NLL or steering term (KL and L2 alone only regularise), or steering tokens without
                steering prompts (or the reverse).
        """
        if (self.towards or self.away) and not self.steer_prompts:
            raise RecipeConfigError("objective has towards/away tokens but no steer_prompts: add the prompts after "
                                    "which their probability is steered (objective.steer_prompts)")
        if self.steer_prompts and not (self.towards or self.away):
            raise RecipeConfigError("objective has steer_prompts but no towards/away tokens: add objective.towards "
                                    "and/or objective.away")
        names = []
        if self.targets:
            names.append("nll")
        if self.towards:
            names.append("towards")
        if self.away:
            names.append("away")
        if not names:
            raise RecipeConfigError("objective has no terms to train for (KL and L2 only regularise): give "
                                    "objective.targets (prompt/target pairs) or objective.steer_prompts with "
                                    "objective.towards/away tokens")
        if self.kl_prompts:
            names.append("kl")
        if self.l2_weight:
            names.append("l2")
        return names

    def loss_terms(self, log_probs: torch.Tensor, batch: dict[str, torch.Tensor], towards_ids: torch.Tensor,
                   away_ids: torch.Tensor, reference: torch.Tensor | None,
                   deltas: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
        """The terms on one batch of rows (see :func:`recipes.delta.rows.collate_rows`), scored at their last
        position.

        Args:
            log_probs: ``[B, V]`` float32 next-token log-probabilities at each row's last position, the deltas
                patched in.
            batch: per row ``kind``, ``target``, ``weight``, ``kl_index`` ``[B]`` (and the token ids, unread here).
            towards_ids, away_ids: ``[K]`` token ids of :attr:`towards` and :attr:`away`.
            reference: ``[n_kl_prompts, V]`` unpatched log-probabilities after each KL prompt (``None`` without
                :attr:`kl_prompts`).
            deltas: the delta tensors (the L2 term and ``norm/<i>``).

        Returns:
            ``loss`` (weighted sum), the unweighted terms present in the batch (``nll``, ``towards``, ``away``,
            ``kl``, ``l2``), the probabilities ``p_target``, ``p_towards``, ``p_away`` (detached) and ``norm/<i>``,
            the L2 norm of delta ``i`` (detached).
        """
        names = self.term_names()
        kind = batch["kind"]
        terms: dict[str, torch.Tensor] = {}
        loss = log_probs.new_zeros(())
        rows = kind == KIND_TARGET
        if "nll" in names and bool(rows.any()):
            terms["nll"], terms["p_target"] = target_nll(log_probs[rows], batch["target"][rows], batch["weight"][rows])
            loss = loss + self.nll_weight * terms["nll"]
        rows = kind == KIND_STEER
        if bool(rows.any()):
            if "towards" in names:
                terms["towards"], terms["p_towards"] = towards_loss(log_probs[rows], towards_ids)
                loss = loss + self.towards_weight * terms["towards"]
            if "away" in names:
                terms["away"], terms["p_away"] = away_loss(log_probs[rows], away_ids)
                loss = loss + self.away_weight * terms["away"]
        rows = kind == KIND_KL
        if "kl" in names and reference is not None and bool(rows.any()):
            terms["kl"] = kl_loss(reference[batch["kl_index"][rows]], log_probs[rows])
            loss = loss + self.kl_weight * terms["kl"]
        if "l2" in names:
            terms["l2"] = l2_penalty(list(deltas))
            loss = loss + self.l2_weight * terms["l2"]
        for i, delta in enumerate(deltas):
            terms[f"norm/{i}"] = delta.detach().norm()
        terms["loss"] = loss
        return terms


def position_slice(position: Position) -> Any:
    """The AddPatch ``slice`` for a :class:`DeltaSpec` position on a ``[batch, seq, ...]`` activation.

    Args:
        position: ``"all"``, ``"last"`` or a negative int.

    Returns:
        ``None`` for ``"all"``, else ``(slice(None), index)`` with a negative ``index``.

    Raises:
        RecipeConfigError: an unknown string, or an int ``>= 0`` (rows are left-padded, so only positions counted
            from the end name the same token in every row).
    """
    if position == "all":
        return None
    if position == "last":
        return (slice(None), -1)
    if isinstance(position, int) and not isinstance(position, bool):
        if position >= 0:
            raise RecipeConfigError(f"delta position {position} counts from the start, but batches are left-padded; "
                                    f"count from the end instead (-1 is the last token)")
        return (slice(None), position)
    raise RecipeConfigError(f"delta position {position!r} is not one of 'all', 'last' or a negative int")
