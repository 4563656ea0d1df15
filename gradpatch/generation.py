"""``pg.generate``: transformers' own generation loop running the PatchableGraph, with the model's KV cache.

transformers' ``generate`` calls the model once on the prompt (prefill) and then once per new token, with the
cache (the ``cache`` argument from transformers 5.24 on, ``past_key_values`` before it — :func:`cache_argument` —
``DynamicCache`` by default, ``StaticCache`` with ``cache_implementation="static"``) and ``cache_position``. Here
each of those calls runs the graph: the cache is a graph input, its method calls
(``cache.update(k_embed, value_states, layer)``) are nodes, and the prefill and decode calls get graphs
of their own kind (extracted once each), whose NodePaths are the same names. So one ``pg.patch`` block applies at
prefill and at every decode step, at every node; a patch's ``slice`` indexes the tokens of the current forward pass
(see :mod:`gradpatch.positions` for positions in the whole sequence), and a ``ProbePatch``/``RecordPatch`` sees one
value per forward pass: ``[batch, prompt, ...]`` at prefill, then ``[batch, 1, ...]`` per new token.

``use_cache=False`` keeps recomputing the whole sequence at every step; it is the default for a model whose forward
takes no cache argument (:func:`cache_argument` is ``None``), which transformers would otherwise give a
``DynamicCache`` built from layer counts its config may not have. A transformers model without ``GenerationMixin``
(``PreTrainedModel`` stopped inheriting it in transformers 4.50) generates through :func:`generation_view`, with
:func:`default_generation_config` when it has no generation config of its own. An all-ones ``attention_mask`` (no
padding) is left out of the graph's calls, so attention runs as in eager mode without a mask.
"""

from __future__ import annotations

import copy
import functools
import inspect
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from .errors import PatchShapeError
from .optional import transformers
from .positions import Window, token_window


_UNSET = object()


@dataclass
class _Progress:
    """Where generation is: the prompt length, the forward passes run, and whether the mask is left out."""

    prompt_length: int
    step: int = 0
    drop_mask: bool | None = None


def cache_argument(model: nn.Module) -> str | None:
    """The name under which ``model.forward`` takes a transformers KV cache: ``"cache"`` (transformers ≥ 5.24, which
    renamed it), ``"past_key_values"`` (earlier versions), or ``None`` when its signature has neither (or none can be
    read)."""
    try:
        parameters = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return None
    return next((name for name in ("cache", "past_key_values") if name in parameters), None)


def default_generation_config(model: nn.Module) -> Any:
    """A copy of ``model.generation_config``; for a transformers ``PreTrainedModel`` without one (a model class that
    does not inherit ``GenerationMixin`` gets none from transformers), the generation settings of its config
    (``GenerationConfig.from_model_config``: ``max_length`` and the like, else transformers' defaults); ``None`` for
    any other module."""
    own = getattr(model, "generation_config", None)
    if own is not None:
        return copy.deepcopy(own)
    config = getattr(model, "config", None)
    if transformers.AVAILABLE and isinstance(model, transformers.PreTrainedModel) and config is not None:
        return transformers.GenerationConfig.from_model_config(config)
    return None


def generation_view(model: nn.Module) -> nn.Module:
    """``model`` itself when it has ``generate``; for a transformers ``PreTrainedModel`` without ``GenerationMixin``,
    a view of it whose class adds ``GenerationMixin`` after the model's own (transformers' recommended class layout,
    so the model's ``prepare_inputs_for_generation`` and other overrides come first).

    The view shares the model's ``__dict__`` (parameters, submodules, config, hooks): nothing is copied and the
    model's own class is left as it is.

    Raises:
        TypeError: ``model`` has no ``generate`` and is not a transformers ``PreTrainedModel``.
    """
    if callable(getattr(model, "generate", None)):
        return model
    if not (transformers.AVAILABLE and isinstance(model, transformers.PreTrainedModel)):
        raise TypeError(f"{type(model).__name__} has no generate() and is not a transformers PreTrainedModel; "
                        f"generate with a transformers model, or call the graph step by step")
    view = object.__new__(_with_generation_mixin(type(model)))
    object.__setattr__(view, "__dict__", model.__dict__)
    return view


@functools.lru_cache(maxsize=None)
def _with_generation_mixin(model_class: type) -> type:
    return type(model_class.__name__, (model_class, transformers.GenerationMixin),
                {"__module__": model_class.__module__, "__qualname__": model_class.__qualname__})


def generate(graph: Callable[..., Any], model: nn.Module, generation_config: Any, args: tuple,
             kwargs: dict[str, Any]) -> Any:
    """Run ``model.generate(*args, **kwargs)`` with every forward pass going through ``graph``.

    Args:
        graph: the PatchableGraph (called with the model's forward arguments).
        model: the wrapped transformers model (with or without ``GenerationMixin``: :func:`generation_view`).
        generation_config: the default configuration (the model's own is restored afterwards); ``None``: the
            model's own, else :func:`default_generation_config`.
        args, kwargs: the arguments of ``model.generate``; without ``use_cache``, a model whose forward takes no
            cache generates with ``use_cache=False``.

    Raises:
        TypeError: the model has no ``generate`` and is not a transformers ``PreTrainedModel``.
        PatchShapeError: a patch value does not fit a forward pass (the message names the step); the caller's
            cache, if one was passed, is cropped back to its length before that pass (dynamic caches, and static
            ones but for sliding-window layers).
    """
    generator = generation_view(model)
    if cache_argument(model) is None and "use_cache" not in kwargs:
        kwargs = {**kwargs, "use_cache": False}
    if generation_config is None and getattr(model, "generation_config", None) is None:
        generation_config = default_generation_config(model)
    prompt = args[0] if args else kwargs.get("input_ids", kwargs.get("inputs"))
    progress = _Progress(prompt_length=int(prompt.shape[-1]) if isinstance(prompt, torch.Tensor) else 0)
    saved_config = model.__dict__.get("generation_config", _UNSET)
    if generation_config is not None:  # the model's default configuration while generating, as transformers reads it
        model.generation_config = generation_config
    model.forward = _graph_forward(graph, model, progress)
    try:
        return generator.generate(*args, **kwargs)
    finally:
        del model.forward
        if saved_config is _UNSET:
            model.__dict__.pop("generation_config", None)
        else:
            model.generation_config = saved_config


def _graph_forward(graph: Callable[..., Any], model: nn.Module, progress: _Progress) -> Callable[..., Any]:
    signature = inspect.signature(model.forward)
    cache_name = cache_argument(model)

    @functools.wraps(type(model).forward)
    def forward(*args: Any, **kwargs: Any) -> Any:
        call = dict(signature.bind(*args, **kwargs).arguments)
        mask = call.get("attention_mask")
        if isinstance(mask, torch.Tensor):
            if progress.drop_mask is None:  # decided on the prompt; generation only appends ones
                progress.drop_mask = bool(mask.all())
            if progress.drop_mask:
                del call["attention_mask"]
        cache = call.get(cache_name) if cache_name is not None else None
        length = getattr(cache, "get_seq_length", None)
        offset = int(length()) if callable(length) and call.get("use_cache", True) else 0
        try:
            with token_window(Window(offset=offset, prompt_length=progress.prompt_length)):
                return graph(**call)
        except BaseException as error:
            _crop(cache, offset)
            if isinstance(error, PatchShapeError):
                raise PatchShapeError(f"generation step {progress.step} (positions from {offset}): {error}") from error
            raise
        finally:
            progress.step += 1

    forward.__signature__ = signature  # type: ignore[attr-defined]
    return forward


def _crop(cache: Any, length: int) -> None:
    """Cut a cache back to ``length`` tokens, so no half-written step stays in the caller's cache: each dynamic layer
    that got further loses its extra tokens (transformers ≥ 5 crops by a negative count per layer, earlier versions
    the whole cache to a length), and each static full-attention layer is rewound: by its own ``crop`` (transformers
    ≥ 5.24, which moves the position counter back), else by :func:`_rewind_static_layer`.
    A static sliding-window layer, whose positions wrap around, is left as it is."""
    layers = getattr(cache, "layers", None)
    try:
        if layers is None:
            if callable(getattr(cache, "crop", None)) and int(cache.get_seq_length()) > length:
                cache.crop(length)
            return
        for layer in layers:
            extra = int(layer.get_seq_length()) - length
            if extra <= 0:
                continue
            if callable(getattr(layer, "crop", None)):
                layer.crop(-extra)
            elif (isinstance(getattr(layer, "keys", None), torch.Tensor) and hasattr(layer, "max_cache_len")
                  and not getattr(layer, "is_sliding", False)):
                _rewind_static_layer(layer, length)
    except (ValueError, NotImplementedError, AttributeError):
        pass


def _rewind_static_layer(layer: Any, length: int) -> None:
    """Rewind a transformers static cache layer (preallocated ``keys``/``values`` ``[batch, kv_heads, max_len,
    head_dim]``) to ``length`` tokens: the positions from ``length`` on are zeroed, as a fresh layer has them (before
    transformers 5, its length is the count of non-zero key positions), and its position counter
    ``cumulative_length``, where it has one, is set in place (its address is static, for compiled decoding)."""
    counter = getattr(layer, "cumulative_length", None)
    if isinstance(counter, torch.Tensor):
        counter.fill_(length)
    for states in (layer.keys, layer.values):
        states[:, :, length:] = 0
