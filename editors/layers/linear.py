"""The edited layer: a linear map ``y = W k + b`` at a user-chosen NodePath.

ROME edits one linear layer, whatever the model family: a Llama ``model.layers_N.mlp.down_proj``
(``nn.Linear``, weight ``[d_out, d_in]``), a GPT-2 ``transformer.h_N.mlp.c_proj`` (transformers' ``Conv1D``,
weight stored transposed as ``[d_in, d_out]``), or any ``nn.Linear`` of a toy model. :class:`LinearLayer` hides
the weight orientation: the algebra always sees ``W`` as ``[d_out, d_in]`` (the paper's orientation).

A layer whose weight cannot be written in place — a bitsandbytes 8-bit/4-bit layer (quantized storage) or one
that accelerate offloaded (meta placeholders until its hook loads the weights) — is still computed on (its output
comes from running the layer itself) and edited as a patch on its output (:mod:`editors.edits.patches`).
"""

from __future__ import annotations

import contextlib
import inspect
import re
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch import nn

from gradpatch import PatchableGraph
from gradpatch.extraction.dispatch import execution_device
from gradpatch.optional.quantized import is_quantized_parameter
from gradpatch.model_io import model_device, pad_token_id, right_pad

from ..errors import LayerKindError

__all__ = ["LinearLayer", "editable_graph", "input_name", "resolve_linear", "resolve_module"]


def editable_graph(model: nn.Module, tokenizer: Any) -> PatchableGraph:
    """A :class:`gradpatch.PatchableGraph` of a causal LM for editing, in ``eval()``: built on a right-padded batch of
    two prompts with ``use_cache=False``, so any batch size and length runs without a new extraction."""
    texts = ["The capital of France is", "The Eiffel Tower is located in the city of"]
    ids, _ = right_pad([list(tokenizer(t)["input_ids"]) for t in texts], pad_token_id(tokenizer))
    with torch.no_grad():
        pg = PatchableGraph(model, ids.to(model_device(model)), use_cache=False)
    return pg.eval()


def resolve_module(target: nn.Module, node_path: str) -> nn.Module:
    """The submodule at a NodePath, on a PatchableGraph or on a plain model.

    On a PatchableGraph this is ``pg.original_module(node_path)``. On a plain model, NodePath components map to
    attributes, and ``name_N`` indexes a ``ModuleList``/``Sequential`` called ``name`` (``layers_5`` is
    ``layers[5]``), so the same NodePath works on both.

    Raises:
        KeyError: no submodule at that path (the message names the available children), or a NodePath with an
            empty component (``"model..layers_0"``).
    """
    parts = node_path.split(".") if node_path else []
    if "" in parts:
        raise KeyError(f"NodePath {node_path!r} has an empty component; join module names with single dots, "
                       f"e.g. 'model.layers_0.mlp.down_proj'")
    if hasattr(target, "original_module") and hasattr(target, "graph"):
        return target.original_module(node_path)
    module: Any = target
    for part in parts:
        child = getattr(module, part, None) if isinstance(module, nn.Module) else None
        if child is None:
            match = re.fullmatch(r"(.+)_(\d+)", part)
            container = getattr(module, match.group(1), None) if match else None
            if isinstance(container, (nn.ModuleList, nn.Sequential)) and int(match.group(2)) < len(container):
                child = container[int(match.group(2))]
        if not isinstance(child, nn.Module):
            names = [n for n, _ in module.named_children()] if isinstance(module, nn.Module) else []
            raise KeyError(f"No submodule {part!r} in NodePath {node_path!r}; children there: {names}")
        module = child
    return module


def _first_argument_name(module: nn.Module) -> str:
    """Name of the first argument of ``module.forward`` (``input`` for nn.Linear, ``x`` for Conv1D)."""
    params = [p for p in inspect.signature(module.forward).parameters.values() if p.name != "self"]
    if not params:
        raise LayerKindError(f"{type(module).__name__}.forward takes no argument; ROME needs a linear layer")
    return params[0].name


@dataclass(frozen=True)
class LinearLayer:
    """A linear layer chosen for editing.

    Attributes:
        path: NodePath of the layer's module, e.g. ``"model.layers_5.mlp.down_proj"``.
        module: the original module (its ``weight`` is the Parameter the graph uses).
        transposed: ``True`` when the weight is stored ``[d_in, d_out]`` (GPT-2 ``Conv1D``: ``y = x W + b``).
        input_name: name of the module's input node (its forward argument: ``input`` or ``x``).
    """

    path: str
    module: nn.Module
    transposed: bool
    input_name: str

    @property
    def input_node(self) -> str:
        """NodePath of the layer input (the keys ``k``), e.g. ``model.layers_5.mlp.down_proj.input``."""
        return f"{self.path}.{self.input_name}"

    @property
    def output_node(self) -> str:
        """NodePath of the layer output (the values ``W k + b``)."""
        return f"{self.path}.output"

    @property
    def statistics_node(self) -> str:
        """The name the layer's second moment is filed under: its input node."""
        return self.input_node

    def keys_of(self, activations: torch.Tensor) -> torch.Tensor:
        """The keys ``[..., d_in]`` in activations read at :attr:`input_node`: the activations themselves (an expert of
        an MoE block computes them: :meth:`editors.layers.experts.ExpertLayer.keys_of`)."""
        return activations

    def key_weights(self, activations: torch.Tensor) -> None:
        """Each token's weight in the second moment: ``None``, every token counts once (an expert weighs the tokens
        routed to it: :meth:`editors.layers.experts.ExpertLayer.key_weights`)."""
        return None

    @property
    def weight(self) -> torch.Tensor:
        """The weight Parameter as stored (``[d_out, d_in]``, or ``[d_in, d_out]`` when transposed)."""
        return self.module.weight

    @property
    def bias(self) -> torch.Tensor | None:
        """The bias ``[d_out]`` or ``None``."""
        return getattr(self.module, "bias", None)

    @property
    def d_in(self) -> int:
        """Key dimension (input features)."""
        if isinstance(self.module, nn.Linear):
            return int(self.module.in_features)
        return int(self.weight.shape[0 if self.transposed else 1])

    @property
    def d_out(self) -> int:
        """Value dimension (output features)."""
        if isinstance(self.module, nn.Linear):
            return int(self.module.out_features)
        return int(self.weight.shape[1 if self.transposed else 0])

    @property
    def device(self) -> torch.device:
        """Where the layer computes: its weight's device, or accelerate's execution device for an offloaded one."""
        if self.weight.is_meta:
            device = execution_device(self.module)
            return torch.device("cpu") if device is None else device
        return self.weight.device

    @property
    def quantized(self) -> bool:
        """Whether the weight is quantized storage (bitsandbytes' 8-bit or 4-bit parameter classes)."""
        return is_quantized_parameter(self.weight)

    @property
    def offloaded(self) -> bool:
        """Whether accelerate offloaded the weight (a meta placeholder until its hook loads it)."""
        return self.weight.is_meta

    def not_writable(self) -> str:
        """Why the weight cannot be edited in place (``""`` when it can)."""
        if self.quantized:
            return f"the weight of {self.path} is {type(self.weight).__name__} (quantized by bitsandbytes)"
        if self.offloaded:
            return f"the weight of {self.path} is offloaded by accelerate (on the meta device between calls)"
        return ""

    def w(self) -> torch.Tensor:
        """``W`` in the paper's orientation, ``[d_out, d_in]`` (a view, no copy).

        Raises:
            LayerKindError: the weight is quantized or offloaded (see :meth:`not_writable`).
        """
        reason = self.not_writable()
        if reason:
            raise LayerKindError(f"{reason}: it cannot be read as a matrix; use forward_value")
        return self.weight.T if self.transposed else self.weight

    def forward_value(self, keys: torch.Tensor) -> torch.Tensor:
        """``W k + b`` for keys ``[..., d_in]``; returns ``[..., d_out]`` (no patching involved). A quantized or
        offloaded layer computes it by running itself (weights loaded for the call)."""
        if self.not_writable():
            with self._loaded():
                weight = self.weight
                dtype = weight.dtype if weight.is_floating_point() else getattr(self.module, "compute_dtype", None)
                rows = keys.reshape(-1, self.d_in).to(device=self.device, dtype=dtype or keys.dtype)  # kernels: 2-d
                return self.module(rows).to(keys.dtype).reshape(*keys.shape[:-1], self.d_out)
        out = keys.to(self.weight.dtype) @ self.w().T
        return out + self.bias if self.bias is not None else out

    @contextlib.contextmanager
    def _loaded(self) -> Iterator[None]:
        """Offloaded weights loaded for the block (accelerate's ``align_module_device``)."""
        if not self.offloaded:
            yield
            return
        from gradpatch.optional.accelerate import align_module_device

        with align_module_device(self.module):
            yield

    def delta_weight(self, u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The change ``v uᵀ`` (rank one) or ``V Uᵀ`` (rank r) in the weight's storage layout.

        Args:
            u: key-side factor ``[d_in]`` or ``[d_in, r]``.
            v: value-side factor ``[d_out]`` or ``[d_out, r]``.

        Returns:
            ``[d_out, d_in]`` for ``nn.Linear``, ``[d_in, d_out]`` for ``Conv1D``, computed in float64 and
            cast to the weight's dtype.
        """
        u = u.detach().to(device=self.weight.device, dtype=torch.float64)
        v = v.detach().to(device=self.weight.device, dtype=torch.float64)
        if u.dim() == 2:
            delta = u @ v.T if self.transposed else v @ u.T
        else:
            delta = torch.outer(u, v) if self.transposed else torch.outer(v, u)
        return delta.to(self.weight.dtype)


def input_name(target: nn.Module, path: str, module: nn.Module) -> str:
    """The name of the layer's input node: on a PatchableGraph, the first input of its node (``input`` for every
    ``nn.Linear``, quantized ones included); on a plain model, the forward's first argument."""
    node = getattr(target, "node", None)
    if callable(node) and hasattr(target, "graph"):
        first = next(iter(node(path)), None)
        if first is not None:
            return first.name
    return _first_argument_name(module)


def resolve_linear(target: nn.Module, node_path: str) -> LinearLayer:
    """Find the linear layer at ``node_path`` and how its weight is laid out.

    Args:
        target: a :class:`gradpatch.PatchableGraph` (or a plain model, for applying saved edits).
        node_path: NodePath of the layer module (a trailing ``.weight`` is accepted and dropped).

    Raises:
        KeyError: unknown NodePath.
        LayerKindError: the module is not ``nn.Linear`` or a ``Conv1D`` (weight ``[d_in, d_out]`` with ``nf``).
    """
    path = node_path[: -len(".weight")] if node_path.endswith(".weight") else node_path
    module = resolve_module(target, path)
    weight = getattr(module, "weight", None)
    if isinstance(module, nn.Linear):
        transposed = False
    elif isinstance(weight, torch.Tensor) and weight.dim() == 2 and getattr(module, "nf", None) == weight.shape[1]:
        transposed = True  # transformers.pytorch_utils.Conv1D: y = x @ W + b, W [nx, nf]
    else:
        raise LayerKindError(
            f"NodePath {path!r} is a {type(module).__name__}; ROME edits a linear layer (nn.Linear or GPT-2 Conv1D), "
            f"e.g. 'model.layers_5.mlp.down_proj' (Llama) or 'transformer.h_5.mlp.c_proj' (GPT-2), or one expert of an "
            f"MoE block, e.g. 'model.layers_5.mlp.experts.down_proj[0]'"
        )
    if weight.dim() != 2:
        raise LayerKindError(f"{path!r} has a {weight.dim()}-d weight; expected a 2-d linear weight")
    return LinearLayer(path=path, module=module, transposed=transposed, input_name=input_name(target, path, module))
