"""End-to-end dictionary training: the KL between the model's and the spliced model's next-token distributions,
optionally with Braun et al.'s downstream reconstruction terms ("e2e+ds").

Braun et al. 2024 ("Identifying Functionally Important Features with End-to-End Sparse Dictionary Learning",
arXiv 2405.12241, section 2) train an SAE so that the model *with the SAE spliced in* predicts what the model does:

    L_e2e    = KL(p_original ‖ p_spliced) + φ · L_sparsity
    L_e2e+ds = L_e2e + (β_ds / |D|) · Σ_{k ∈ D} MSE(a_k^spliced, a_k^original)

with the KL averaged over every position and D the downstream nodes: in the paper the residual stream after each
layer between the SAE's and the last (their GPT-2 runs: an SAE at ``blocks.6.hook_resid_pre``, D =
``blocks.7 .. blocks.11.hook_resid_pre``). The paper writes ‖a − â‖²₂; its code (``e2e_sae/losses.py``,
``InToOrigLoss``) takes ``F.mse_loss``, the mean over tokens *and* dimensions, with ``total_coeff`` = β_ds split
evenly over D; implemented here as in the code. Their KL coefficient (0.5 in the GPT-2 configs) is 1 here.

Each step runs the frozen graph twice on the batch: once as it is (no gradients; probes read the dictionaries'
nodes and the downstream nodes), once with every dictionary spliced without its error term
(:func:`~recipes.dictionary.spliced.splice_all`); the KL and the downstream MSEs flow back through the layers after
the dictionaries to their weights. The sparsity term is the local recipe's (L1 for ReLU, L0 for JumpReLU; none for
TopK / BatchTopK, whose k fixes it). Logged every step: ``kl``, ``ce_increase`` (CE spliced − CE original on the
batch, from the same two passes), ``downstream_mse`` (with downstream nodes), and per dictionary ``fvu`` at its node
(not optimised), ``l0`` and ``dead_fraction``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from gradpatch import HoldPatch, ProbePatch
from gradpatch.capture import node_activations
from gradpatch.dictionaries import SparseDictionary, normalized_mse
from gradpatch.errors import NodePathError

from ..errors import RecipeConfigError
from ..training.frozen import FrozenGraphModule, OptimizerName
from .module import BDecInit, DictionaryModule
from .spliced import next_token_ce, splice_all

__all__ = ["EndToEndDictionaryModule", "downstream_residual_nodes"]


def downstream_residual_nodes(pg: Any, node: str) -> list[str]:
    """Braun et al.'s downstream nodes for a dictionary writing ``node`` = ``<prefix><i>.output`` (a decoder layer's
    output, e.g. ``model.layers_12.output``): the outputs of layers i+1 .. L−2, L the number of layers found in
    ``pg`` (the residual stream after each later layer but the last, as their GPT-2 configs list).

    Raises:
        RecipeConfigError: ``node`` is not a numbered layer's ``.output``.
    """
    match = re.fullmatch(r"(.*\D)(\d+)\.output", node)
    if match is None:
        raise RecipeConfigError(f"cannot infer downstream layers from {node!r}: give downstream_nodes explicitly "
                                f"(e.g. ['model.layers_13.output', ...])")
    prefix, layer = match.group(1), int(match.group(2))
    found = []
    while True:
        layer += 1
        try:
            pg.node(f"{prefix}{layer}.output")
        except NodePathError:
            return found[:-1]
        found.append(f"{prefix}{layer}.output")


class EndToEndDictionaryModule(DictionaryModule):
    """Train ``dictionary`` (or several, spliced together) on KL(original ‖ spliced), plus β_ds times the mean MSE
    at ``downstream_nodes`` (see the module docstring); no activation buffer (each step needs whole sequences).

    Args:
        pg, dictionary, lr, optimizer, sparsity_coefficient, dead_after_tokens, unit_norm_decoder,
            density_every_n_steps, b_dec_init: as :class:`~recipes.dictionary.DictionaryModule`.
        downstream_nodes: D, the NodePaths whose activations ``[batch, seq, d]`` are compared (e2e+ds); ``()``
            for plain e2e. :func:`downstream_residual_nodes` gives Braun et al.'s choice.
        downstream_coefficient: β_ds, the total weight of the downstream MSEs (split evenly over D).

    Raises:
        RecipeConfigError: as :class:`~recipes.dictionary.DictionaryModule`; a negative ``downstream_coefficient``,
            or a positive one without downstream nodes.
        NodePathError: a downstream NodePath the graph lacks.
    """

    def __init__(self, pg: Any, dictionary: SparseDictionary | Sequence[SparseDictionary], lr: float = 2e-4,
                 optimizer: OptimizerName = "adam", sparsity_coefficient: float = 1e-3,
                 dead_after_tokens: int = 10_000_000, unit_norm_decoder: bool = True,
                 downstream_nodes: Sequence[str] = (), downstream_coefficient: float = 0.0,
                 density_every_n_steps: int = 50, b_dec_init: BDecInit = "mean") -> None:
        super().__init__(pg, dictionary, buffer_rows=1, lr=lr, optimizer=optimizer,
                         sparsity_coefficient=sparsity_coefficient, dead_after_tokens=dead_after_tokens,
                         unit_norm_decoder=unit_norm_decoder, density_every_n_steps=density_every_n_steps,
                         ce_every_n_steps=0, b_dec_init=b_dec_init)
        if downstream_coefficient < 0 or (downstream_coefficient > 0 and not downstream_nodes):
            raise RecipeConfigError(f"downstream_coefficient (β_ds = {downstream_coefficient}) must be >= 0, and "
                                    f"> 0 only with downstream_nodes (e.g. downstream_residual_nodes(pg, node))")
        for node in downstream_nodes:
            pg.node(node)
        self.downstream_nodes = [str(node) for node in downstream_nodes]
        self.downstream_coefficient = float(downstream_coefficient)

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        """One optimizer step on a batch of token ids ``[batch, seq]`` (the first sets the decoder biases to the
        mean of its targets' trained positions, with ``b_dec_init="mean"``)."""
        ids = batch["input_ids"] if isinstance(batch, dict) else batch
        if bool(self.b_dec_pending):
            values = dict(zip(self.nodes, node_activations(self.graph, self.nodes, ids)))
            first = self.exclude_first_positions
            self.initialize_b_dec(lambda index: values[self.nodes_of(index)[1]][:, first:].flatten(0, -2))
        return FrozenGraphModule.training_step(self, ids, batch_idx)

    def loss_terms(self, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """``{"loss", "kl", "ce_increase", ["downstream_mse"], "fvu", "l0", "dead_fraction", ...}`` on token ids
        ``[batch, seq]`` (per-dictionary names suffixed ``/<node>`` when there are several)."""
        pg = self.graph
        probes = {node: ProbePatch() for node in self.nodes + self.downstream_nodes}
        with torch.no_grad(), pg.patch(probes):
            reference = pg(ids, use_cache=False).logits
        captures = {node: HoldPatch() for node in self.downstream_nodes}
        with splice_all(pg, list(self.dictionaries)) as splices, pg.patch(captures):
            logits = pg(ids, use_cache=False).logits
        kl = F.kl_div(F.log_softmax(logits.float(), -1), F.log_softmax(reference.float(), -1), log_target=True,
                      reduction="none").sum(-1).mean()
        terms = {"kl": kl, "ce_increase": (next_token_ce(logits, ids) - next_token_ce(reference, ids)).detach()}
        loss = kl
        if self.downstream_nodes:
            terms["downstream_mse"] = torch.stack([F.mse_loss(captures[node].held.float(),
                                                              probes[node].activation.float())
                                                   for node in self.downstream_nodes]).mean()
            loss = loss + self.downstream_coefficient * terms["downstream_mse"]
        for index, (dictionary, spliced) in enumerate(zip(self.dictionaries, splices)):
            one = self.spliced_terms(index, probes, spliced.latents.reshape(-1, dictionary.d_sae))
            if "penalty" in one:
                loss = loss + self.sparsity_coefficient * one["penalty"]
            terms.update({name + self.suffix(index): value for name, value in one.items()})
        terms["loss"] = loss
        self.log_terms(terms)
        return terms

    def spliced_terms(self, index: int, probes: dict[str, ProbePatch], z: torch.Tensor) -> dict[str, torch.Tensor]:
        """Dictionary ``index``'s ``fvu`` (no gradient), ``l0``, ``dead_fraction`` and, for ReLU / JumpReLU, the
        ``penalty`` (with gradient), from the original pass's probes and the spliced pass's latents ``z``
        ``[n, m]``."""
        dictionary = self.dictionaries[index]
        read, write = self.nodes_of(index)
        first = self.exclude_first_positions  # the spliced positions only, those of z
        x = probes[read].activation[:, first:].reshape(-1, dictionary.d_in).to(dictionary.W_enc.dtype)
        with torch.no_grad():
            target = probes[write].activation[:, first:].reshape(-1, dictionary.d_out).to(x.dtype)
            terms = {"fvu": normalized_mse(dictionary.output(x, z), target)}
        self.track_firing(index, z)
        if dictionary.config.activation in ("relu", "jumprelu"):  # activations without side effects: z again, with grad
            h = dictionary.pre_activations(x)
            terms.update(self.sparsity_terms(index, h, dictionary.activate(h)))
        return {**terms, **self.firing_terms(index, z)}

