"""End-to-end dictionary training: the KL between the model's and the spliced model's next-token distributions.

Braun et al. 2024 ("Identifying Functionally Important Features with End-to-End Sparse Dictionary Learning",
arXiv 2405.12241, section 2) train an SAE so that the model *with the SAE spliced in* predicts what the model does:

    L_e2e = KL(p_original ‖ p_spliced) + λ · sparsity(z)

averaged over every position. Here each step runs the frozen graph twice on the batch: once as it is (no gradients),
once with the dictionary spliced without its error term (:func:`gradpatch.dictionaries.splice`); the KL flows back
through the downstream layers of the patched graph to the dictionary. The sparsity term is the local recipe's (L1 for
ReLU, L0 for JumpReLU; none for TopK / BatchTopK, whose k fixes it). The FVU of the dictionary at its node and the
mean L0 are logged beside the KL (not optimised). The downstream reconstruction terms of Braun et al.'s "e2e+ds"
variant are not implemented.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from gradpatch import ProbePatch
from gradpatch.dictionaries import SparseDictionary, normalized_mse, splice

from ..training.frozen import FrozenGraphModule, OptimizerName
from .module import DictionaryModule

__all__ = ["EndToEndDictionaryModule"]


class EndToEndDictionaryModule(DictionaryModule):
    """Train ``dictionary`` on KL(original ‖ spliced) (see the module docstring); no activation buffer (each step
    needs whole sequences).

    Args:
        pg, dictionary, lr, optimizer, sparsity_coefficient, dead_after_tokens, unit_norm_decoder: as
            :class:`~recipes.dictionary.DictionaryModule`.

    Raises:
        RecipeConfigError: as :class:`~recipes.dictionary.DictionaryModule`.
    """

    def __init__(self, pg: Any, dictionary: SparseDictionary, lr: float = 2e-4, optimizer: OptimizerName = "adam",
                 sparsity_coefficient: float = 1e-3, dead_after_tokens: int = 10_000_000,
                 unit_norm_decoder: bool = True) -> None:
        super().__init__(pg, dictionary, buffer_rows=1, lr=lr, optimizer=optimizer,
                         sparsity_coefficient=sparsity_coefficient, dead_after_tokens=dead_after_tokens,
                         unit_norm_decoder=unit_norm_decoder)

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        """One optimizer step on a batch of token ids ``[batch, seq]``."""
        ids = batch["input_ids"] if isinstance(batch, dict) else batch
        return FrozenGraphModule.training_step(self, ids, batch_idx)

    def loss_terms(self, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """``{"loss", "kl", "fvu", "l0", "dead_fraction", ...}`` on token ids ``[batch, seq]``."""
        pg, dictionary = self.graph, self.dictionary
        read, write = self.nodes[0], self.nodes[-1]
        probes = {read: ProbePatch(), write: ProbePatch()}  # one probe when they coincide (an SAE)
        with torch.no_grad(), pg.patch(probes):
            reference = pg(ids, use_cache=False).logits
        spliced = splice(pg, dictionary, read, output_node=write, error_term=False)
        with pg.patch(spliced):
            logits = pg(ids, use_cache=False).logits
        kl = F.kl_div(F.log_softmax(logits.float(), -1), F.log_softmax(reference.float(), -1), log_target=True,
                      reduction="none").sum(-1).mean()
        x = probes[read].activation.reshape(-1, dictionary.d_in)
        z = spliced.latents.reshape(-1, dictionary.d_sae)  # the spliced pass's, detached
        with torch.no_grad():
            fvu = normalized_mse(dictionary.output(x, z), probes[write].activation.reshape(-1, dictionary.d_out))
        self.track_firing(z)
        terms = {"kl": kl, "fvu": fvu}
        if dictionary.config.activation in ("relu", "jumprelu"):  # activations without side effects: z again, with grad
            h = dictionary.pre_activations(x)
            terms.update(self.sparsity_terms(h, dictionary.activate(h)))
        terms["loss"] = kl + self.sparsity_coefficient * terms["penalty"] if "penalty" in terms else kl
        return self.logged(terms, z)
