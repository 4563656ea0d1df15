"""MEMIT's hyperparameters (Meng et al. 2023, arXiv 2210.07229): ROME's value search and statistics settings, plus the
context prefixes, ``λ`` of eq. 14, the passes' size, the value search's dtype and an optional true-answer term."""

from __future__ import annotations

from dataclasses import dataclass

from .batch_value import DEFAULT_MAX_TOKENS
from .rome_config import ROMEConfig

__all__ = ["MEMITConfig"]


@dataclass
class MEMITConfig(ROMEConfig):
    """MEMIT's hyperparameters: ROME's value search and statistics settings (:class:`editors.rome.ROMEConfig`), plus:

    Attributes:
        value_prefixes: context prefixes of the value search (6: the reference code's templates, the empty one and
            five others; ROME uses 11).
        key_prefixes: context prefixes the keys and residuals are averaged over (6, as the reference code).
        mom2_update_weight: ``λ`` of eq. 14 (15,000, the reference code's value for GPT-J).
        max_tokens: tokens per forward pass of the batched value search and the key passes.
        value_dtype: ``"bfloat16"`` (or ``"float16"``, ``"float32"``) runs the batched value search on a copy of the
            model in that dtype (:class:`editors.search_copy.SearchCopy`: the model's current weights, cast; memory:
            the parameters once more in that dtype); ``None``: on the model itself. Keys, residuals, statistics and
            the update stay in the model's dtype and float64. On a float32 model on 2 CPU cores, bfloat16 made the
            batched search 1.69x faster per fact at batch 100 (docs/memit.md, "The value search in bfloat16").
        true_logit_weight: ``λ_true`` of a value-search term that keeps each fact's true-answer logit from falling
            (:class:`editors.true_answer.TrueAnswerTerm`; not in the papers; needs ``target_true``). 0 (default): the
            papers' objective. At 0.5, AlphaEdit's neighbourhood score on 3 sequential batches of 100 development
            facts rose from 0.892 to 0.956 for 0.020 of efficacy, on 10 batches of 100 evaluation facts from 0.777 to
            0.925 for 0.081 of efficacy (docs/memit.md, "Keeping the true answer's logit").
    """

    value_prefixes: int | None = 6
    key_prefixes: int | None = 6
    mom2_update_weight: float = 15000.0
    max_tokens: int = DEFAULT_MAX_TOKENS
    value_dtype: str | None = None
    true_logit_weight: float = 0.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.true_logit_weight >= 0:
            raise ValueError(f"true_logit_weight must be 0 (the papers' objective) or positive, got "
                             f"{self.true_logit_weight}")
