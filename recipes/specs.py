"""Configuration records of the delta recipes: where the deltas go and what they are trained to do.

These dataclasses are what ``recipes/configs/*.yaml`` spell out under ``model:``; LightningCLI (through
jsonargparse) builds them from the YAML mappings, and :class:`~recipes.delta_module.DeltaModule` also accepts plain
dicts with the same keys (that is how hyperparameters come back from a checkpoint).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any, TypeVar, Union

import torch

from .errors import RecipeConfigError
from .objectives import delta_loss_terms

__all__ = ["DeltaSpec", "Objective", "TargetSpec", "as_spec", "position_slice", "spec_dict"]

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

    It is the objective of :class:`~recipes.delta_module.DeltaModule`: :meth:`loss_terms` has the interface of
    :class:`~recipes.intervention_objectives.InterventionObjective` (not its subclass: LightningCLI reads a plain
    dataclass as its fields, ``objective.targets``..., and a subclass as ``class_path``/``init_args``).

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

    def loss_terms(self, module: Any, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The terms on one batch of rows of a :class:`~recipes.delta_module.DeltaModule`
        (:func:`recipes.objectives.delta_loss_terms`)."""
        return delta_loss_terms(self, module, batch)


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


SpecT = TypeVar("SpecT")


def as_spec(cls: type[SpecT], value: Any) -> SpecT:
    """``value`` as a ``cls`` dataclass: returned as is if it already is one, built from it if it is a mapping.

    Raises:
        RecipeConfigError: a mapping with unknown keys, or another type.
    """
    if isinstance(value, cls):
        return value
    if isinstance(value, dict):
        known = {f.name for f in fields(cls)}  # type: ignore[arg-type]
        unknown = sorted(set(value) - known)
        if unknown:
            raise RecipeConfigError(f"unknown {cls.__name__} keys {unknown}; valid keys: {sorted(known)}")
        return cls(**value)
    raise RecipeConfigError(f"expected a {cls.__name__} or a mapping of its fields, got {type(value).__name__}")


def spec_dict(value: Any) -> Any:
    """A dataclass (or a list of them) as plain dicts and lists, for hyperparameters and YAML."""
    if isinstance(value, list):
        return [spec_dict(item) for item in value]
    if hasattr(value, "__dataclass_fields__"):
        return asdict(value)
    return value
