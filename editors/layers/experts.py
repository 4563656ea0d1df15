"""One expert of a mixture-of-experts block as an edited layer: a slice ``[e]`` of a fused 3-D experts weight.

transformers stores the experts of an MoE block fused (Qwen3-MoE, Mixtral, and every block written with
``use_experts_implementation`` in the same layout): ``experts.gate_up_proj`` ``[E, 2·I, d_model]`` and
``experts.down_proj`` ``[E, d_model, I]``, expert ``e`` computing

    expert_e(x) = down_proj[e] · k_e(x),    k_e(x) = act(gate_e x) ⊙ (up_e x)    (gate_e, up_e: gate_up_proj[e]'s halves)

and the block ``moe(x) = Σ_{k ∈ top-k(x)} w_k(x) · expert_k(x)``, ``w`` the router's (``mlp.gate``) top-k weights
(0 for an expert outside a token's top-k). ROME's edit (Meng et al. 2022, arXiv 2202.05262 eq. 2) of expert ``e``'s
down-projection is :class:`ExpertLayer`:

- **weight**: ``W_e = down_proj[e]`` ``[d_model, I]`` (``[d_out, d_in]``, nn.Linear's orientation), a view of the fused
  parameter: :meth:`editors.Edit.apply` writes that slice in place (the other experts' slices are not written) and
  :meth:`~editors.Edit.restore` writes back its bit-identical copy;
- **key** ``k* = k_e(x)`` at the subject's last token, computed from the block input ``x`` with expert ``e``'s own
  ``gate_up_proj[e]``, whether or not the router sends that token to ``e`` (so every context prompt gives a key);
- **value**: ``W_e + v uᵀ`` changes the block output at a token by ``w_e(x) (uᵀ k_e(x)) v`` (0 where ``e`` is not in
  the token's top-k; routing itself is unchanged: the router reads ``x``, upstream of the edit). ROME's value search
  runs through exactly that change (:func:`editors.edits.patches.layer_patches`), so ``δ = v`` is the change of
  expert ``e``'s own output at ``k*``, ``v_e* = expert_e(x) + δ``, and the block output moves by ``w_e δ`` (ROME's
  ``v*`` for the block is ``moe(x) + w_e δ``, i.e. ``v_e* = expert_e(x) + (v* − moe(x)) / w_e``);
- **statistics** ``C_e = Σ_t a_t k_e(x_t) k_e(x_t)ᵀ / Σ_t a_t`` over the corpus tokens: ``a_t = 1`` for the tokens the
  router sends to ``e`` (the keys ``e`` really sees), :data:`UNROUTED_KEY_WEIGHT` for the others — a prior from the
  expert's keys of every token that keeps ``C_e`` invertible when few tokens route to ``e`` (a tiny model on a toy
  corpus, a rarely used expert).

NodePaths: ``"model.layers_3.mlp.experts.down_proj[2]"`` names expert 2; ``"model.layers_3.mlp.experts.down_proj"``
(no index) leaves the choice to the editor (:class:`editors.ROME`: the expert the subject's last token routes to most
strongly, :func:`top_expert`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from ..errors import LayerKindError
from .linear import input_name, resolve_module

__all__ = ["UNROUTED_KEY_WEIGHT", "ExpertLayer", "expert_path", "resolve_expert_layer", "top_expert"]

#: ``a_t`` of a token the router does not send to the expert, in the expert's second moment (see the module doc).
UNROUTED_KEY_WEIGHT = 0.01

_EXPERT_PATH = re.compile(r"(?P<owner>.+)\.(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:\[(?P<index>-?\d+)\])?")


def expert_path(fused: str, expert: int) -> str:
    """The NodePath of one expert's slice: ``expert_path("model.layers_3.mlp.experts.down_proj", 2)`` is
    ``"model.layers_3.mlp.experts.down_proj[2]"``."""
    return f"{fused}[{expert}]"


@dataclass(frozen=True)
class ExpertLayer:
    """Expert ``expert``'s down-projection inside a fused experts weight (see the module doc for the design).

    It offers what the editors read from a :class:`editors.layers.LinearLayer` (``path``, ``module``, ``device``,
    ``input_node``, ``output_node``, ``weight``, ``w()``, ``d_in``, ``d_out``, ``forward_value``, ``delta_weight``,
    ``keys_of``, ``key_weights``, ``statistics_node``): ``input_node`` is the MoE block's input ``x``
    ``[batch, seq, d_model]``, from which :meth:`keys_of` computes the expert's keys, and ``output_node`` the block's
    output, where an edit's change shows.

    Attributes:
        path: NodePath of the slice, e.g. ``"model.layers_3.mlp.experts.down_proj[2]"``, or of the fused weight with
            ``expert`` ``None`` (the editor chooses the expert per fact; :meth:`with_expert`).
        fused_path: NodePath of the fused weight, e.g. ``"model.layers_3.mlp.experts.down_proj"``.
        block_path: NodePath of the MoE block, e.g. ``"model.layers_3.mlp"``.
        expert: the expert index ``e`` (``0 <= e < n_experts``), or ``None``.
        module: the experts module (holds ``gate_up_proj``, ``down_proj``, ``act_fn``).
        router: the block's router (``gate``: ``x [T, d_model] -> (logits, top-k weights [T, k], top-k indices
            [T, k])``).
        input_name: name of the block's input node (``hidden_states``).
    """

    path: str
    fused_path: str
    block_path: str
    expert: int | None
    module: nn.Module
    router: nn.Module
    input_name: str

    @property
    def n_experts(self) -> int:
        """``E``, the number of experts."""
        return int(self.fused.shape[0])

    @property
    def fused(self) -> nn.Parameter:
        """The fused down-projection ``[E, d_model, I]``."""
        return self.module.down_proj

    @property
    def input_node(self) -> str:
        """The MoE block's input ``x`` ``[batch, seq, d_model]`` (the expert's keys are computed from it)."""
        return f"{self.block_path}.{self.input_name}"

    @property
    def output_node(self) -> str:
        """The MoE block's output ``[batch, seq, d_model]``."""
        return f"{self.block_path}.output"

    @property
    def statistics_node(self) -> str:
        """The name the expert's second moment is filed under: ``model.layers_3.mlp.experts.down_proj[2].input``."""
        return f"{self.path}.input"

    @property
    def weight(self) -> torch.Tensor:
        """``down_proj[e]`` ``[d_model, I]``, a view of the fused parameter.

        Raises:
            LayerKindError: no expert chosen (``expert`` is ``None``).
        """
        return self.fused[self._index()]

    @property
    def d_in(self) -> int:
        """``I``, the expert's intermediate width (key dimension)."""
        return int(self.fused.shape[2])

    @property
    def d_out(self) -> int:
        """``d_model`` (value dimension)."""
        return int(self.fused.shape[1])

    @property
    def device(self) -> torch.device:
        """Where the fused weight lives."""
        return self.fused.device

    def not_writable(self) -> str:
        """Why the weight cannot be edited in place (``""`` when it can)."""
        return f"the experts weight of {self.fused_path} is offloaded (meta device)" if self.fused.is_meta else ""

    def with_expert(self, expert: int) -> "ExpertLayer":
        """This fused weight's expert ``expert``.

        Raises:
            LayerKindError: ``expert`` is not in ``[0, n_experts)``.
        """
        if not 0 <= expert < self.n_experts:
            raise LayerKindError(f"{self.fused_path} holds {self.n_experts} experts; expert {expert} is out of range: "
                                 f"name one of 0..{self.n_experts - 1}, e.g. '{expert_path(self.fused_path, 0)}'")
        return ExpertLayer(expert_path(self.fused_path, expert), self.fused_path, self.block_path, expert, self.module,
                           self.router, self.input_name)

    def _index(self) -> int:
        if self.expert is None:
            raise LayerKindError(f"{self.fused_path} is a fused experts weight and no expert is chosen: name one, "
                                 f"e.g. '{expert_path(self.fused_path, 0)}'")
        return self.expert

    def w(self) -> torch.Tensor:
        """``W_e`` ``[d_out, d_in]`` (a view)."""
        return self.weight

    def forward_value(self, keys: torch.Tensor) -> torch.Tensor:
        """``W_e k`` for keys ``[..., d_in]`` -> ``[..., d_out]``: the expert's output before its router weight."""
        return keys.to(self.fused.dtype) @ self.w().T

    def delta_weight(self, u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``v uᵀ`` (or ``V Uᵀ``) ``[d_out, d_in]`` in float64, cast to the weight's dtype (as a linear layer's)."""
        u = u.detach().to(device=self.fused.device, dtype=torch.float64)
        v = v.detach().to(device=self.fused.device, dtype=torch.float64)
        return (v @ u.T if u.dim() == 2 else torch.outer(v, u)).to(self.fused.dtype)

    def keys_of(self, hidden: torch.Tensor) -> torch.Tensor:
        """``k_e(x) = act(gate_e x) ⊙ (up_e x)`` ``[..., I]`` for block inputs ``x`` ``[..., d_model]``, routed to the
        expert or not."""
        gate_up = self.module.gate_up_proj[self._index()]  # [2·I, d_model]
        gate, up = nn.functional.linear(hidden.to(gate_up.dtype), gate_up).chunk(2, dim=-1)
        return self.module.act_fn(gate) * up

    def routes(self, hidden: torch.Tensor) -> torch.Tensor:
        """The router's weights of every expert ``[..., E]`` for block inputs ``[..., d_model]``: the top-k weights
        the block multiplies the experts' outputs by, 0 for the experts outside a token's top-k."""
        flat = hidden.reshape(-1, hidden.shape[-1]).to(self.router.weight.dtype)
        _, weights, indices = self.router(flat)  # [T, k], [T, k]
        dense = torch.zeros(len(flat), self.n_experts, dtype=weights.dtype, device=weights.device)
        return dense.scatter_add(1, indices, weights).reshape(*hidden.shape[:-1], self.n_experts)

    def routing_weight(self, hidden: torch.Tensor) -> torch.Tensor:
        """``w_e(x)`` ``[...]`` for block inputs ``[..., d_model]`` (0 where ``e`` is not in the token's top-k)."""
        return self.routes(hidden)[..., self._index()]

    def key_weights(self, hidden: torch.Tensor) -> torch.Tensor:
        """``a_t`` ``[...]`` of each token in the expert's second moment: 1 if routed to ``e``, else
        :data:`UNROUTED_KEY_WEIGHT`."""
        routed = self.routing_weight(hidden) > 0
        prior = torch.full(routed.shape, UNROUTED_KEY_WEIGHT, dtype=torch.float64, device=routed.device)
        return prior.masked_fill(routed, 1.0)


def top_expert(layer: ExpertLayer, hidden: torch.Tensor) -> int:
    """The default expert of a fact: the largest router weight at the subject's last token, averaged over the key
    prompts (the context prefixes, and the subject-first prompt).

    Args:
        layer: the fused experts weight.
        hidden: the block inputs at the subject's last token ``[P, d_model]``.
    """
    return int(layer.routes(hidden).mean(dim=0).argmax())


def resolve_expert_layer(target: nn.Module, node_path: str) -> ExpertLayer | None:
    """The :class:`ExpertLayer` at ``node_path`` (``"<experts>.down_proj[e]"`` or ``"<experts>.down_proj"``), or
    ``None`` when the path does not name a 3-D parameter of a module.

    Args:
        target: a PatchableGraph or the model.
        node_path: the NodePath.

    Raises:
        LayerKindError: a fused weight that is not an experts down-projection of the supported layout (concatenated
            ``gate_up_proj``, not transposed, no bias), a block without a ``gate`` router, or an expert index out of
            range.
    """
    match = _EXPERT_PATH.fullmatch(node_path)
    if match is None or "." not in match["owner"]:
        return None
    try:
        module = resolve_module(target, match["owner"])
    except KeyError:
        return None
    fused = getattr(module, match["name"], None)
    if not isinstance(fused, nn.Parameter) or fused.dim() != 3:
        return None
    fused_path = f"{match['owner']}.{match['name']}"
    layout = {"has_gate": True, "has_bias": False, "is_transposed": False, "is_concatenated": True,
              "has_post_expert_norm": False}
    odd = {key: getattr(module, key, value) for key, value in layout.items() if getattr(module, key, value) != value}
    if match["name"] != "down_proj" or not isinstance(getattr(module, "gate_up_proj", None), nn.Parameter) or odd:
        raise LayerKindError(f"{fused_path} is a fused {tuple(fused.shape)} weight of {type(module).__name__} "
                             f"{odd or ''}; the editors edit the down_proj of experts with a concatenated gate_up_proj "
                             f"[E, 2·I, d], down_proj [E, d, I] and no bias (Qwen3-MoE, Mixtral layout)")
    block_path = match["owner"].rsplit(".", 1)[0]
    block = resolve_module(target, block_path)
    router = getattr(block, "gate", None)
    if not isinstance(router, nn.Module) or not isinstance(getattr(router, "weight", None), torch.Tensor):
        raise LayerKindError(f"The MoE block {block_path} has no router 'gate' with a weight; the editors need "
                             f"the block's top-k router to know which tokens reach {fused_path}")
    layer = ExpertLayer(fused_path, fused_path, block_path, None, module, router, input_name(target, block_path, block))
    return layer if match["index"] is None else layer.with_expert(int(match["index"]))

