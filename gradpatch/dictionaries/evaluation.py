"""Evaluating a dictionary on a model, as the field defines it (SAELens's metrics).

For batches of token ids, three forward passes each: the model as it is (probes read the dictionary's nodes), the
model with the dictionary spliced *without* its error term, and the model with the written node zero-ablated. Over
all tokens (positions where the attention mask is 1):

- ``fvu`` = Σ‖y − ŷ‖² / Σ‖y − mean(y)‖² (y the written node's value, ŷ the dictionary's output; the mean over all
  tokens); ``explained_variance`` = 1 − fvu;
- ``l0``: mean active latents per token; ``dead_fraction``: latents that fired on no token;
- ``ce_loss_original``, ``ce_loss_spliced``, ``ce_loss_zero_ablation``: the mean next-token cross-entropy over every
  position that has a next token; ``ce_loss_recovered`` = (CE_zero − CE_spliced) / (CE_zero − CE_original), SAELens's
  definition (NaN when zero ablation does not change the loss);
- ``kl``: mean of KL(p_original ‖ p_spliced) over every position of every sequence (the attention mask's), the CE
  losses' positions plus each sequence's last one, whose KL is defined without a next token (SAELens's
  ``kl_div_with_sae`` averages over the same positions);
- ``n_tokens``: the tokens counted in the activation metrics (``fvu`` .. ``dead_fraction``).

A dictionary whose config has ``exclude_first_positions`` n > 0 is spliced, and the node zero-ablated, at positions
n.. only (:func:`~gradpatch.dictionaries.trained_positions`; the first n keep the model's values), and its activation
metrics count those positions only. The CE losses and the KL still average over every position, the first n
included (there the spliced model is the model: they add 0 to the KL's sum and the same loss to each CE), so that
they compare with SAELens's and with runs that exclude nothing.

:meth:`DictionaryMetrics.to_dict` (``metrics.json``) holds each metric under our name and, for the five SAELens
reports, under SAELens's name too (:data:`SAELENS_NAMES`): the same numbers.

:func:`~gradpatch.dictionaries.evaluate_layers` (:mod:`gradpatch.dictionaries.layers_evaluation`) scores
dictionaries at many layers at once.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ..patches import ProbePatch, ZeroPatch
from .modules import SparseDictionary
from .splice import Splice, splice, trained_positions

__all__ = ["DictionaryMetrics", "SAELENS_NAMES", "evaluate_dictionary"]

#: SAELens's name of a metric (``sae_lens.evals.get_downstream_reconstruction_metrics``) -> our field of the same
#: number.
SAELENS_NAMES: dict[str, str] = {"ce_loss_without_sae": "ce_loss_original", "ce_loss_with_sae": "ce_loss_spliced",
                                 "ce_loss_with_ablation": "ce_loss_zero_ablation", "ce_loss_score": "ce_loss_recovered",
                                 "kl_div_with_sae": "kl"}


@dataclass
class DictionaryMetrics:
    """What :func:`evaluate_dictionary` measures (module docstring); :meth:`to_dict` gives the JSON keys."""

    fvu: float
    explained_variance: float
    l0: float
    dead_fraction: float
    ce_loss_original: float
    ce_loss_spliced: float
    ce_loss_zero_ablation: float
    ce_loss_recovered: float
    kl: float
    n_tokens: int

    def to_dict(self) -> dict[str, Any]:
        """The fields by name, then the same numbers under SAELens's names (:data:`SAELENS_NAMES`)."""
        fields = asdict(self)
        return {**fields, **{saelens: fields[ours] for saelens, ours in SAELENS_NAMES.items()}}


class MetricSums:
    """Running float64 sums over tokens."""

    def __init__(self, d_out: int, d_sae: int) -> None:
        self.error = 0.0
        self.sum = torch.zeros(d_out, dtype=torch.float64)
        self.square = 0.0
        self.active = 0.0
        self.fired = torch.zeros(d_sae, dtype=torch.bool)
        self.tokens = 0
        self.losses = {"original": 0.0, "spliced": 0.0, "zero": 0.0}
        self.positions = 0
        self.kl = 0.0
        self.kl_positions = 0

    def add_activations(self, target: torch.Tensor, output: torch.Tensor, latents: torch.Tensor) -> None:
        target, output = target.double(), output.double()
        if self.tokens == 0:  # the width from the first tokens (evaluate_layers does not know it before)
            self.sum = torch.zeros(target.shape[-1], dtype=torch.float64)
        self.error += float((target - output).pow(2).sum())
        self.sum += target.sum(0).cpu()
        self.square += float(target.pow(2).sum())
        self.active += float((latents > 0).sum())
        self.fired |= (latents > 0).any(0).cpu()
        self.tokens += target.shape[0]

    def metrics(self) -> DictionaryMetrics:
        mean = self.sum / max(self.tokens, 1)
        variance = self.square - self.tokens * float(mean.pow(2).sum())
        fvu = self.error / variance if variance > 0 else float("nan")
        ce = {name: value / max(self.positions, 1) for name, value in self.losses.items()}
        span = ce["zero"] - ce["original"]
        return DictionaryMetrics(
            fvu=fvu, explained_variance=1.0 - fvu, l0=self.active / max(self.tokens, 1),
            dead_fraction=float((~self.fired).double().mean()), ce_loss_original=ce["original"],
            ce_loss_spliced=ce["spliced"], ce_loss_zero_ablation=ce["zero"],
            ce_loss_recovered=(ce["zero"] - ce["spliced"]) / span if span != 0 else float("nan"),
            kl=self.kl / max(self.kl_positions, 1), n_tokens=self.tokens)


def next_token_losses(logits: torch.Tensor, ids: torch.Tensor, scored: torch.Tensor) -> torch.Tensor:
    """Σ of −log p(next token) over the ``scored`` positions ``[batch, seq − 1]`` (scalar)."""
    losses = F.cross_entropy(logits[:, :-1].float().flatten(0, 1), ids[:, 1:].flatten(), reduction="none")
    return (losses * scored.flatten()).sum()


def evaluate_dictionary(pg: Any, dictionary: SparseDictionary, batches: Iterable[torch.Tensor | Mapping[str, Any]],
                        node: str | None = None, output_node: str | None = None) -> DictionaryMetrics:
    """SAELens-style metrics of ``dictionary`` spliced into ``pg`` (module docstring).

    Args:
        pg: the :class:`~gradpatch.PatchableGraph` (its forward returns ``.logits``).
        dictionary: the SAE or transcoder (on the model's device).
        batches: token ids ``[batch, seq]``, or mappings with ``input_ids`` and optionally ``attention_mask``
            (passed to the model; masked positions are not counted).
        node, output_node: the NodePaths read and written (default: the dictionary's config's).

    Returns:
        The metrics over all batches.

    Raises:
        DictionaryConfigError, NodePathError, DictionaryShapeError: as :func:`~gradpatch.dictionaries.splice`.
    """
    spliced = splice(pg, dictionary, node, output_node=output_node, error_term=False,
                     slice=trained_positions(dictionary))
    sums = MetricSums(dictionary.d_out, dictionary.d_sae)
    training = dictionary.training
    dictionary.eval()  # BatchTopK: per-token latents with its threshold, no update of it
    try:
        for batch in batches:
            inputs = dict(batch) if isinstance(batch, Mapping) else {"input_ids": batch}
            _add_batch(pg, spliced, inputs, sums)
    finally:
        dictionary.train(training)
    return sums.metrics()


def _add_batch(pg: Any, spliced: Splice, inputs: dict[str, Any], sums: MetricSums) -> None:
    """The three forward passes of one batch, added to ``sums``."""
    ids = inputs["input_ids"]
    mask = inputs.get("attention_mask", torch.ones_like(ids)).bool()
    scored = mask[:, :-1] & mask[:, 1:]
    probes = {spliced.input_node: ProbePatch(), spliced.output_node: ProbePatch()}  # one probe when they coincide
    first = spliced.patch.dictionary.config.exclude_first_positions
    pg.prepare(**inputs, use_cache=False)  # this batch's graphs, extracted without a warning the user cannot act on
    with torch.no_grad():
        with pg.patch(probes):
            original = pg(**inputs, use_cache=False).logits
        with pg.patch(spliced):
            logits = pg(**inputs, use_cache=False).logits
        with pg.patch({spliced.output_node: ZeroPatch(slice=spliced.patch.slice)}):
            zero = pg(**inputs, use_cache=False).logits
        counted = mask[:, first:]
        if counted.any():  # else a batch no longer than the excluded positions: nothing spliced, no latents
            x = probes[spliced.input_node].activation[:, first:][counted]
            y = probes[spliced.output_node].activation[:, first:][counted]
            latents = spliced.latents[counted]  # the spliced pass read the unchanged input node
            sums.add_activations(y, spliced.patch.dictionary.output(x, latents), latents)
        for name, value in (("original", original), ("spliced", logits), ("zero", zero)):
            sums.losses[name] += float(next_token_losses(value, ids, scored))
        log_p, log_q = F.log_softmax(original.float(), -1), F.log_softmax(logits.float(), -1)
        sums.kl += float(((log_p.exp() * (log_p - log_q)).sum(-1) * mask).sum())
        sums.positions += int(scored.sum())
        sums.kl_positions += int(mask.sum())
