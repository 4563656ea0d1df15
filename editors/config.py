"""The editors' hyperparameters: ROME's (:class:`ROMEConfig`) and MEMIT's (:class:`MEMITConfig`, Meng et al. 2023,
arXiv 2210.07229: ROME's value search and statistics settings, plus the context prefixes, ``λ`` of eq. 14, the passes'
size, the value search's dtype and an optional true-answer term).

This module imports nothing heavy (no torch), so the ``gradpatch`` command reads their defaults for ``--help``."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from .defaults import DEFAULT_MAX_LENGTH, DEFAULT_MAX_TOKENS, DEFAULT_MOM2_RELATIVE_WEIGHT, DEFAULT_N_SAMPLES, LENGTH_PARAMS

__all__ = ["MEMITConfig", "ROMEConfig", "check_true_logit_weight"]


@dataclass
class ROMEConfig:
    """Hyperparameters of ROME (defaults: the reference implementation's, context templates as the paper).

    Attributes:
        steps: maximum Adam steps of the value optimisation.
        lr: Adam learning rate.
        kl_factor: weight of the KL term on the "{subject} is a" prompt.
        kl_in_context: read the KL prompt behind the first non-empty context prefix
            (:func:`editors.value.search.kl_context_prefix`: ``"<prefix>{subject} is a"``) instead of at the start of
            the text (the paper's). With ``subject_first_key`` the paper's KL prompt reads the subject-first key, which
            the update gives all of ``δ``, so the KL term held subject-first prompts to the unedited answer. On by
            default for ROME (chosen on the 100 development facts of the prompt-form suite: the same scores in every
            form, subject-first margins +0.78 nats on average, the smallest 0.22 → 1.68; docs/rome.md, "The KL prompt
            behind a context prefix"); MEMIT and AlphaEdit keep the paper's.
        weight_decay: weight of ``‖δ‖ / ‖v₀‖²``. The reference GPT-2 XL value 0.5 is too strong for small models:
            on SmolLM2-135M (``‖v₀‖ ≈ 15`` at down_proj) the term alone stays above the 0.05 early-stop threshold
            once ``δ`` reaches the clamp, so every edit ran all steps; 1e-3 is the reference Llama value.
        clamp_factor: maximum ``‖δ‖ / ‖v₀‖``.
        early_stop_loss: stop the optimisation once the loss is below this.
        n_samples: corpus documents for the second moment.
        max_length: token truncation of corpus documents.
        stats_batch_size: documents per forward pass when computing the statistics.
        context_length_params: ``(tokens, count)`` of the sampled context prefixes.
        template_seed: seed of the context prefix sampling.
        value_prefixes: how many of the prefixes the value optimisation uses (the empty one and others spread
            evenly over both lengths; ``None``: all). The key always averages over all of them (one cheap,
            early-stopped forward pass); each optimisation step costs a forward and backward pass over these
            prompts, so 11 of the 21 halves the time of an edit.
        cache_dir: statistics / template cache folder (``None``: ``$GRADPATCH_STATS_DIR`` or
            ``~/.cache/gradpatch/stats``).
        use_cache: read and write the disk cache.
        progress: show progress bars.
        allow_unconverged: let :meth:`ROME.edit` apply an edit whose value search did not converge (its last loss
            not below its first, or non-finite); by default such an edit raises
            :class:`~editors.errors.EditNotConvergedError` and the weights stay as they were.
        keys_per_context: solve for every context's key (``uᵀ k_j = 1`` for each of the context prompts,
            :func:`editors.solve.rank_one.update_direction`) instead of their average (eq. 3); still a rank-one update.
            On by default for ROME since the prompt-form suite (with ``subject_first_key``; chosen on the development
            suite, where it won every subject-first prompt the averaged key lost for one neighbourhood prompt:
            docs/rome.md, "The subject-first key, chosen on the development suite"). MEMIT and AlphaEdit (each
            fact's context keys as columns with its residual) keep it off: higher efficacy and paraphrase scores, but
            0.033 (MEMIT, 300 development facts) and 0.044 (AlphaEdit, 10 × 100) less neighbourhood score
            (docs/memit.md, "Keys per context").
        subject_first_key: also solve for the key of the subject at the start of the text (the subject alone, after
            the start token if any: the key of every prompt that begins with the subject, which no context prefix
            gives unless the rewrite prompt itself begins with it). ROME: ``uᵀ k = 1`` for it too (beside every
            context's key, or beside ``k*``), and it is averaged into ``k*``; a prompt that begins with the subject
            has this key already (behind the empty prefix) and it is not added twice. MEMIT and AlphaEdit: one more
            column of ``K`` per fact with the fact's residual (``λ`` still from the context keys; with
            ``keys_per_context`` a prompt that begins with the subject has that column twice). On by default for
            ROME (above).
        start_token: a token put before every text the editor reads and scores (keys, values, statistics, context
            prefixes, and the evaluation through :attr:`Editor.tokenizer <editors.editor.Editor.tokenizer>`), so that
            no subject sits at position 0, the attention sink (:mod:`editors.passes.start_token`). ``"auto"``
            (default): ``<|endoftext|>`` where the vocabulary has it, else the tokenizer's BOS token; a token; or
            ``None``. A tokenizer that adds a BOS token itself (Llama) gets nothing more. On the 20 development cases
            whose prompts begin with their subject it carried the edit to 17 of their 22 subject-first paraphrases
            (12 without), 4 of 8 with a one-token subject (0 without) (docs/rome.md, "The start token"). Score and
            generate with the editor's ``tokenizer``: the edit was written for texts that begin with the token.

        value_through_update: ROME's value search reads the model through the rank-one update it will write
            (``W + δ uᵀ``: ``(uᵀ k) δ`` at every token, :class:`editors.value.ValueObjective`'s ``direction``), so what it
            optimises is what the edit does; ``False``: ``δ`` added at the subject's last token of every prompt (the
            paper's search), under which edits of prompts that begin with their subject reported convergence while
            losing on their own rewrite prompt (docs/rome.md, "The value search through the update"). MEMIT's batched
            search adds ``δ`` at the subject whatever this says.

    Raises:
        ValueError: ``start_token`` an empty string.
    """

    steps: int = 25
    lr: float = 0.5
    kl_factor: float = 0.0625
    kl_in_context: bool = True
    weight_decay: float = 1e-3
    clamp_factor: float = 4.0
    early_stop_loss: float = 0.05
    n_samples: int = DEFAULT_N_SAMPLES
    max_length: int = DEFAULT_MAX_LENGTH
    stats_batch_size: int = 16
    context_length_params: tuple[tuple[int, int], ...] = LENGTH_PARAMS
    template_seed: int = 0
    value_prefixes: int | None = 11
    cache_dir: str | None = None
    use_cache: bool = True
    progress: bool = True
    allow_unconverged: bool = False
    keys_per_context: bool = True
    subject_first_key: bool = True
    start_token: str | None = "auto"
    value_through_update: bool = True

    def __post_init__(self) -> None:
        if self.start_token == "":
            raise ValueError("start_token is an empty string: give a token of the vocabulary, 'auto', or None for none")
        if not self.early_stop_loss >= 0:
            raise ValueError(f"early_stop_loss must be 0 (run every step) or positive, got {self.early_stop_loss}")

    def to_json(self) -> dict[str, Any]:
        """The hyperparameters as a JSON-able dict."""
        data = asdict(self)
        data["context_length_params"] = [list(p) for p in self.context_length_params]
        return data


@dataclass
class MEMITConfig(ROMEConfig):
    """MEMIT's hyperparameters: ROME's value search and statistics settings (:class:`editors.rome.ROMEConfig`), plus:

    Attributes:
        value_prefixes: context prefixes of the value search (6: the reference code's templates, the empty one and
            five others; ROME uses 11).
        key_prefixes: context prefixes the keys and residuals are averaged over (6, as the reference code).
        mom2_update_weight: an absolute ``λ`` of eq. 14 (the reference code's 15,000 for GPT-J), or ``None``
            (default): ``λ`` relative to the statistics, ``mom2_relative_weight`` times the edited keys' mean
            ``kᵀC⁻¹k`` at each layer (:func:`editors.solve.multi_update.relative_update_weight`).
        mom2_relative_weight: that multiple. ``kᵀC⁻¹k`` is dimensionless (``d_in`` on average for keys like the
            corpus's), so one value writes the same fraction of a fact's residual whatever the model's width and key
            scale; 0.6, chosen on the development split (docs/memit.md, "The relative weight swept on the development
            split").
        max_tokens: tokens per forward pass of the batched value search and the key passes.
        value_dtype: ``"bfloat16"`` (or ``"float16"``, ``"float32"``) runs the batched value search on a copy of the
            model in that dtype (:class:`editors.value.search_copy.SearchCopy`: the model's current weights, cast;
            memory: the parameters once more in that dtype); ``None``: on the model itself. Keys, residuals, statistics
            and the update stay in the model's dtype and float64. On a float32 model on 2 CPU cores, bfloat16 made the
            batched search 1.69x faster per fact at batch 100 (docs/memit.md, "The value search in bfloat16").
        true_logit_weight: ``λ_true`` of a value-search term that keeps each fact's true-answer logit from falling
            (:class:`editors.value.true_answer.TrueAnswerTerm`; not in the papers; needs ``target_true``). 0 (default):
            the papers' objective. At 0.5, AlphaEdit's neighbourhood score on 3 sequential batches of 100 development
            facts rose from 0.892 to 0.956 for 0.020 of efficacy, on 10 batches of 100 evaluation facts from 0.777 to
            0.925 for 0.081 of efficacy (docs/memit.md, "Keeping the true answer's logit").
        start_token: as ROME's (``"auto"``). MEMIT's earlier figures (docs/memit.md) were measured on texts without one
            (``None``); with ``"auto"`` it scored within 0.005 of them on 100 development facts and carried the edit to
            more subject-first prompts (docs/memit.md, "Prompt forms and the start token").
        kl_in_context: as ROME's, but off by default (not measured for MEMIT or AlphaEdit).
        keys_per_context: as ROME's, but off by default (see ROME's).
        subject_first_key: on by default (with ``"auto"``, chosen on the 100 development facts of the prompt-form
            suite: subject-first prompts 0.814 → 0.943 for 0.020 of neighbourhood score; docs/memit.md, "The
            subject-first key").
    """

    value_prefixes: int | None = 6
    key_prefixes: int | None = 6
    mom2_update_weight: float | None = None
    mom2_relative_weight: float = DEFAULT_MOM2_RELATIVE_WEIGHT
    max_tokens: int = DEFAULT_MAX_TOKENS
    value_dtype: str | None = None
    true_logit_weight: float = 0.0
    kl_in_context: bool = False
    keys_per_context: bool = False
    subject_first_key: bool = True
    start_token: str | None = "auto"

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.mom2_relative_weight > 0:
            raise ValueError(f"mom2_relative_weight must be positive, got {self.mom2_relative_weight}")
        if self.mom2_update_weight is not None and not self.mom2_update_weight >= 0:
            raise ValueError(f"mom2_update_weight must be 0 or positive (or None: relative to the statistics), got "
                             f"{self.mom2_update_weight}")
        check_true_logit_weight(self.true_logit_weight)


def check_true_logit_weight(weight: float) -> None:
    """The one check of ``true_logit_weight`` (``λ_true`` of :class:`editors.value.true_answer.TrueAnswerTerm`), made by
    :class:`MEMITConfig` and by the value search's term when it is built without a configuration.

    Raises:
        ValueError: ``weight`` is negative or NaN (the message names the setting and the command-line option).
    """
    if not weight >= 0:
        raise ValueError(f"true_logit_weight must be 0 or positive (0: the papers' objective; --true-logit-weight on "
                         f"the command line), got {weight:g}")
