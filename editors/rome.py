"""ROME (Meng et al. 2022, arXiv 2202.05262): rank-one model editing at a chosen linear layer.

Pipeline for one fact ``(subject, prompt, target_new)``, every text read after the start token
(``config.start_token``, :mod:`editors.passes.start_token`: ``<|endoftext|>`` on SmolLM2 and GPT-2, nothing on a
tokenizer that adds a BOS token itself), so that no subject sits at position 0:

1. ``k*`` — the layer input at the subject's last token, averaged over context prefixes (eq. 3) and, by default
   (``subject_first_key``), the key where a text begins with the subject;
2. ``C = E[k kᵀ]`` — the layer input's second moment over a corpus (cached on disk);
3. ``v* = W k* + b + δ`` — ``δ`` optimised through an AddPatch at the layer output (eq. 4);
4. ``W' = W + (v* - W k*)(C⁻¹k*)ᵀ / ((C⁻¹k*)ᵀ k*)`` — the closed-form rank-one update (eq. 2), with the same
   averaged ``k*`` in both factors (mixing the averaged key with the bare prompt's key causes the
   model-collapsing edits described in "Rebuilding ROME", Gupta et al. 2024). By default (``keys_per_context``)
   ``u`` solves ``uᵀk_j = 1`` for every context's key and the subject-first key instead, still rank one
   (:func:`editors.solve.rank_one.update_direction`), so each of those prompts gains the whole ``δ``.

**Mixture of experts** (:mod:`editors.layers.experts`): the node ``model.layers_3.mlp.experts.down_proj[2]`` edits
expert 2's slice of the fused down-projection (``...down_proj`` alone: the subject's top-1 expert). ``k*`` is that expert's
down-projection input ``act(gate_e x) ⊙ (up_e x)`` computed from the block input ``x`` (routed or not), ``C`` its
keys' second moment over the tokens routed to it, and the value search runs through the update, whose effect on
the block output is scaled by the expert's router weight ``w_e`` at each token.

Usage::

    pg = PatchableGraph(model, example_ids, use_cache=False)
    rome = ROME(pg, tokenizer, "model.layers_3.mlp.down_proj")
    edit = rome.edit(EditRequest("The capital of {} is", "France", "London"))   # computed and applied
    ids = rome.tokenizer("France's capital city is", return_tensors="pt").input_ids  # after the start token
    ...
    edit.restore(pg)                                                          # bit-identical weights
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch
from torch import nn

from gradpatch import model_fingerprint
from gradpatch.model_io import wrapped_model

from .config import ROMEConfig
from .defaults import DEFAULT_SMOLLM2_NODE
from .editor import Editor, value_record
from .edits.edit import Edit
from .errors import EditError, StatisticsError
from .evaluation.sequential import BatchApplier, rome_applier
from .layers import ExpertLayer, expert_path, top_expert
from .layers import LinearLayer, resolve_layer
from .requests import EditRequest
from .solve.rank_one import update_direction
from .statistics.corpus import Corpus
from .statistics.keys import context_activations, subject_first_activations
from .statistics.second_moment import SecondMoment, layer_second_moments
from .value.rewrite import rewrite_check
from .value.search import StepCallback, ValueObjective, ValueResult, ValueRunner, optimize_value

__all__ = ["DEFAULT_SMOLLM2_NODE", "ROME", "ROMEConfig"]

class ROME(Editor):
    """Compute and apply ROME edits at one linear layer of a PatchableGraph.

    The statistics and the context prefixes are computed once per instance (and cached on disk), so a series of
    edits pays for them once.

    Args:
        pg: the model's :class:`gradpatch.PatchableGraph` (in ``eval()`` mode).
        tokenizer: the model's tokenizer.
        node: NodePath of the edited linear layer (``nn.Linear`` or GPT-2 ``Conv1D``), e.g.
            ``"model.layers_3.mlp.down_proj"`` or ``"transformer.h_5.mlp.c_proj"``; or one expert's down-projection of
            an MoE block, ``"model.layers_3.mlp.experts.down_proj[2]"`` (expert 2; :mod:`editors.layers.experts`), or the
            fused weight ``"model.layers_3.mlp.experts.down_proj"``: each fact then edits the expert its subject's last token
            routes to most strongly (the largest router weight at this layer, averaged over the key prompts; recorded
            as ``edit.info["expert"]``, with ``info["router_weight"]``, its mean weight ``w_e``).
        config: hyperparameters.
        corpus: corpus of the statistics (``None``: the built-in Wikipedia summaries; a path; a list of strings;
            a :class:`editors.statistics.Corpus`).
        statistics: precomputed ``C`` to use instead of computing / loading it.
        value_runner: minimises the value objective (default :func:`editors.value.optimize_value`, the plain-torch
            loop; ``recipes.rome_value.LightningValueRunner`` runs it under ``Trainer.fit`` with TensorBoard logs).

    Raises:
        KeyError, LayerKindError: ``node`` is not a linear layer of the graph (or an expert index is out of range).
        ValueError: ``statistics`` given for a fused experts weight without an expert index, or
            ``config.value_through_update`` off for an expert.
    """

    method = "rome"

    def __init__(
        self,
        pg: nn.Module,
        tokenizer: Any,
        node: str,
        config: ROMEConfig | None = None,
        corpus: Corpus | str | os.PathLike[str] | Any | None = None,
        statistics: SecondMoment | torch.Tensor | None = None,
        value_runner: ValueRunner = optimize_value,
    ) -> None:
        self.layer: LinearLayer | ExpertLayer = resolve_layer(pg, node)
        routed = isinstance(self.layer, ExpertLayer) and self.layer.expert is None
        if routed and statistics is not None:
            raise ValueError(f"statistics= belong to one expert: name it in the node, e.g. "
                             f"'{expert_path(self.layer.fused_path, 0)}', or leave statistics out")
        config = config or ROMEConfig()
        if isinstance(self.layer, ExpertLayer) and not config.value_through_update:
            raise ValueError(f"{node} is an MoE expert, whose edit moves each prompt by its router weight: its value "
                             f"search runs through the update; set value_through_update=True (the default)")
        super().__init__(pg, tokenizer, [self.layer], config, corpus=corpus,
                         statistics=None if statistics is None else [statistics])
        self.value_runner = value_runner
        self.last_value: ValueResult | None = None
        self._expert_statistics: dict[str, SecondMoment] = {}

    @property
    def node(self) -> str:
        """NodePath of the edited layer."""
        return self.layer.path

    def statistics(self, layer: LinearLayer | ExpertLayer | None = None) -> SecondMoment:
        """``C`` at the layer input (memoised; read from / written to the disk cache): of the edited layer, or of
        ``layer``, an expert of the edited fused weight chosen for a fact.

        Raises:
            LayerKindError: the node is a fused experts weight without an expert index and no ``layer`` is given.
        """
        layer = layer or self.layer
        if layer is self.layer:
            return self.layer_statistics()[0]
        if layer.path not in self._expert_statistics:
            c = self.config
            self._expert_statistics[layer.path] = layer_second_moments(
                self.pg, self.tokenizer, [layer], corpus=self.corpus, n_samples=c.n_samples, max_length=c.max_length,
                batch_size=c.stats_batch_size, cache_dir=c.cache_dir, use_cache=c.use_cache, progress=c.progress)[0]
        return self._expert_statistics[layer.path]

    def applier(self) -> BatchApplier:
        """A batch's facts edited one after another (:func:`~editors.evaluation.rome_applier` over :meth:`compute`)."""
        return rome_applier(self.pg, self.compute)

    def compute(self, request: EditRequest, callback: StepCallback | None = None) -> Edit:
        """Compute the edit for one fact without touching the weights.

        Args:
            request: the fact to write.
            callback: called with ``(step, loss terms)`` during the value optimisation.

        Returns:
            The :class:`Edit` (not applied); ``edit.info`` holds losses (``first_loss``, ``loss``: the first and last
            evaluated), ``converged`` (the search converged and, for a request with ``target_true``, the edit wins on
            its own rewrite prompt: ``rewrite``, :func:`editors.value.rewrite.rewrite_check`), steps, norms, timings
            and ``start_token`` (the token every text was read after, ``None`` for none: prompt the edited model the
            same way).

        Raises:
            EditError: the graph is in training mode, or the named expert gets router weight 0 at the subject's last
                token in every key prompt (the message lists the experts it routes to).
            StatisticsError: the statistics are unusable, or the contexts' keys admit no rank-one update (names the
                node and the subject).
            NonFiniteError: the value search met a non-finite loss term, gradient or value (named with its step).
        """
        self.check_eval()
        c, layer = self.config, self.layer
        templates = self.templates()
        fingerprint = model_fingerprint(wrapped_model(self.pg))
        t0 = time.perf_counter()
        contexts = context_activations(self.pg, self.tokenizer, [layer.input_node], [(request.prompt, request.subject)],
                                       templates)[0][0]  # [P, d]: the layer's input at the subject's last token
        # the subject alone: its key where a text begins with it, [1, d_in]; a prompt that begins with the subject
        # already has that key behind the empty prefix: adding it again would count it twice in k*
        first = None
        if c.subject_first_key:
            if request.prompt.startswith("{}") and "" in templates.prefixes:
                first = contexts[templates.prefixes.index("")].unsqueeze(0)
            else:
                first = subject_first_activations(self.pg, self.tokenizer, [layer.input_node], [request.subject])[0][0]
                contexts = torch.cat([contexts, first])
        if isinstance(layer, ExpertLayer):  # the keys of the expert named, or of the subject's top-1 expert
            with torch.no_grad():
                layer = layer if layer.expert is not None else layer.with_expert(top_expert(layer, contexts))
                routing = layer.routing_weight(contexts)  # [P]: w_e at each key prompt (0: not routed to e)
                if not bool(routing.max() > 0):
                    mean = layer.routes(contexts).mean(dim=0).tolist()
                    routed = {e: round(w, 3) for e, w in enumerate(mean) if w > 0}
                    raise EditError(f"The router never sends {request.subject!r}'s last token to expert {layer.expert} "
                                    f"of {layer.fused_path} in the key prompts, so editing it cannot write this fact: "
                                    f"edit an expert it routes to (mean weights {routed}) or leave the index out")
                contexts, first = layer.keys_of(contexts), None if first is None else layer.keys_of(first)
        stats = self.statistics(layer)
        key = contexts.mean(dim=0)  # k* (eq. 3), [d_in]
        # the keys u must give the whole residual: every context's, or k* (and the subject-first key beside it)
        solved = contexts if c.keys_per_context else key if first is None else torch.cat([key.unsqueeze(0), first])
        t1 = time.perf_counter()
        try:  # u (eq. 2) depends on the keys alone: solved before the value search, so bad keys fail fast
            with torch.no_grad():
                u = update_direction(solved, stats.matrix)
        except StatisticsError as exc:
            raise StatisticsError(f"{layer.path}, subject {request.subject!r}: {exc}") from None
        t_update = time.perf_counter()
        with torch.no_grad():
            v_init = layer.forward_value(key)  # W k* + b, [d_out]
        objective = ValueObjective(
            self.pg, self.tokenizer, layer, request, templates.subset(c.value_prefixes), v_init,
            kl_factor=c.kl_factor, weight_decay=c.weight_decay, clamp_factor=c.clamp_factor,
            kl_in_context=c.kl_in_context,
            direction=u.to(device=v_init.device, dtype=v_init.dtype) if c.value_through_update else None,
        )
        result = self.value_runner(objective, steps=c.steps, lr=c.lr, early_stop_loss=c.early_stop_loss,
                                   callback=callback)
        self.last_value = result
        t2 = time.perf_counter()
        # v* = W k* + δ, so v = v* - W k* = δ (eq. 2): no weight is read, so quantized layers are edited too
        v = result.delta.detach().to(device=u.device, dtype=torch.float64)
        info = value_record(result, c.early_stop_loss, ("loss", "nll", "kl", "target_prob"))
        rewrite = rewrite_check(self.pg, self.tokenizer, layer, request, u, v)
        if rewrite is not None and not rewrite["wins"]:
            info["converged"] = False  # whatever the search's loss did, the edit does not write the fact
        info |= {
            "rewrite": rewrite,
            "v_init_norm": float(v_init.norm()),
            "key_norm": float(key.norm()),
            "n_key_prompts": len(contexts),
            "n_value_prompts": len(objective.rewrite),
            "start_token": self.start_token,
            "statistics": {"n_tokens": stats.n_tokens, "n_samples": stats.n_samples, "corpus": stats.corpus},
            **({"expert": layer.expert, "router_weight": float(routing.mean())}
               if isinstance(layer, ExpertLayer) else {}),
            "timings_s": {"key": t1 - t0, "value": t2 - t_update, "update": t_update - t1},
            "config": c.to_json(),
        }
        return Edit(node=layer.path, u=u, v=v, request=request, model_fingerprint=fingerprint, info=info)

    def edit(self, request: EditRequest, callback: StepCallback | None = None) -> Edit:
        """Compute the edit for one fact and apply it in place (``edit.restore(pg)`` undoes it exactly).

        Several calls edit several facts in sequence: each edit is computed on the model with the earlier
        ones applied. A failure leaves the weights as they were.

        Raises:
            EditNotConvergedError: the value search did not converge and ``config.allow_unconverged`` is ``False``.
            NonFiniteError: the value search met a non-finite loss term, gradient or value.
        """
        edit = self.compute(request, callback=callback)
        return edit.apply(self.pg, allow_unconverged=self.config.allow_unconverged)
